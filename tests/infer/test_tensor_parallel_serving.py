"""Tensor-parallel serving on CPU over gloo: a model split over two ranks gives the same greedy
tokens as HuggingFace transformers and as one rank, for a dense and an MoE model, through `LLM`
and through `tessera serve` over HTTP; bad sizes are refused before any process starts, and a
worker that fails makes rank 0 fail naming it instead of hanging. The ranks talk over loopback
only, an interrupted step or a dropped `LLM` leaves nothing hung or running, and a server whose
ranks failed says so on /health."""

import gc
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.config.hf_config import read_hf_config
from tessera.hf import load_pretrained
from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.config import EngineConfig
from tessera.infer.runner.tensor_parallel import serving_dims
from tessera.infer.runner.tp_workers import WorkerFailure, WorkerGroup, WorkerSource, check_device_count, rank_device
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer, serve_main, serving_url, wait_until_serving
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


def _serve_two_ranks(path, **popen_options) -> tuple[subprocess.Popen, str]:
    """`tessera serve` of `path` at tensor_parallel_size=2 on the CPU, its output piped, on a port
    the system chose (--port 0), and its URL once it answers."""
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", "0",
                             "--block-size", "4", "--device", "cpu", "--tensor-parallel-size", "2",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, **popen_options)
    try:
        url = serving_url(proc)
        wait_until_serving(proc, url)
    except BaseException:
        if popen_options.get("start_new_session"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(HANG_S)
        raise
    return proc, url


@pytest.mark.dist
@pytest.mark.slow
def test_serve_with_two_ranks_answers_like_one(llama):
    path, _ = llama
    want = LLM(path, block_size=4).generate(["contract"], SamplingParams(max_tokens=8, temperature=0))[0].text
    proc, url = _serve_two_ranks(path)
    try:
        body = {"model": str(path), "prompt": "contract", "max_tokens": 8, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        children = _children(proc.pid)
        assert children  # the worker (and multiprocessing's resource tracker)
        proc.terminate()  # SIGTERM: a clean stop, workers included
        assert proc.wait(HANG_S) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(HANG_S)
    deadline = time.monotonic() + HANG_S  # the worker sees rank 0 go and exits
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
    for method in ("int8", "fp8", "int4"):  # quantized weights are served on one rank
        with pytest.raises(ConfigError, match=f"quantization='{method}'.*tensor_parallel_size=2"):
            EngineConfig(tensor_parallel_size=2, quantization=method)
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
        # the rank's traceback is kept (and logged), not put into the message, which reaches HTTP clients
        assert "Traceback" in e.value.detail and "Traceback" not in str(e.value)
    finally:
        group.stop()
    assert not torch.distributed.is_initialized()


@pytest.mark.dist
def test_worker_that_dies_while_serving_is_named(llama):
    path, _ = llama
    llm = LLM(path, tensor_parallel_size=2, block_size=4)
    try:
        assert llm.generate(["hi"], GREEDY)[0].finish_reason == "length"
        worker = llm.engine.executor.workers.procs[0]
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


@pytest.mark.dist
def test_perplexity_on_two_ranks_equals_one_rank(llama, monkeypatch):
    """Perplexity scores through the executor: on two ranks every rank runs the packed forward and
    rank 0 reads full-vocabulary rows, so it equals one rank's. The text fills two windows of
    max_model_len tokens, the second ending on a chunk of one token that predicts nothing."""
    from tessera.infer import LLMEngine
    from tessera.infer.engine.perplexity import perplexity
    from tessera.infer.runner.tp_executor import TensorParallelExecutor

    path, _ = llama
    options = dict(block_size=4, max_model_len=24, enable_prefix_caching=False)
    one = LLMEngine.from_dir(path, EngineConfig(**options))
    ids = one.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice: the")[:45]
    assert len(ids) == 45  # windows of 24 and 21 tokens: chunks of 5, the last with no target
    want = perplexity(one, ids, chunk=5)
    engine = LLMEngine.from_dir(path, EngineConfig(tensor_parallel_size=2, **options))
    try:
        assert isinstance(engine.executor, TensorParallelExecutor)
        calls = []
        real = engine.executor.score

        def score(chunks):
            calls.append(len(chunks))
            return real(chunks)

        monkeypatch.setattr(engine.executor, "score", score)
        assert perplexity(engine, ids, chunk=5) == pytest.approx(want, rel=1e-5)
        assert calls == [1] * 10
        # the cache it borrowed is free again, and generation goes on as on one rank
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert [o.token_ids for o in _run(engine, [ids[:6]])] == [o.token_ids for o in _run(one, [ids[:6]])]
    finally:
        engine.close()


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host order) as text."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                out.add((_address(addr), int(port, 16)))
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_ctrl_c_to_the_process_group_lets_the_request_in_flight_finish(llama):
    """Ctrl-C in a terminal reaches every process of the group, workers included: they ignore it,
    and rank 0 finishes the stream in flight, stops them and exits 0."""
    path, _ = llama
    proc, url = _serve_two_ranks(path, start_new_session=True)
    try:
        body = {"model": str(path), "prompt": "contract", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the request is in flight ...
            os.killpg(proc.pid, signal.SIGINT)  # ... when every process of the group gets Ctrl-C
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-3:]
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(HANG_S)


@pytest.mark.dist
@pytest.mark.slow
def test_serve_exits_with_status_1_when_a_worker_dies(llama):
    """A dead rank makes every later request fail: the server says why and ends with status 1 for
    its supervisor to restart it, without waiting for a request to notice."""
    path, _ = llama
    proc, _ = _serve_two_ranks(path)
    try:
        workers = [c for c in _children(proc.pid)
                   if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        status = proc.wait(HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(HANG_S)
    out = proc.stdout.read().decode()
    assert status == 1, out
    assert "tessera serve: error: tensor-parallel rank 1 exited with code -9; the server shut down" in out, out


@pytest.mark.dist
def test_ranks_listen_on_loopback_only(llama):
    """The store has no authentication and the groups' sockets carry the model's activations:
    neither may be reachable from another machine."""
    path, _ = llama
    cfg = read_hf_config(path)
    before = _listening(os.getpid())
    group = WorkerGroup(2, EngineConfig(tensor_parallel_size=2), WorkerSource(str(path), sliced=True, cfg=cfg))
    try:
        serving_dims(cfg, 2).build_mesh("cpu")
        group.wait_ready()
        mine = _listening(os.getpid()) - before
        assert group.store.port in {port for _, port in mine}
        worker = _listening(group.procs[0].pid)
        assert worker  # gloo's listener
        loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
        assert {a for a, _ in mine | worker} <= loopback, (mine, worker)
    finally:
        group.stop()
    assert (group.store, os.environ.get("GLOO_SOCKET_IFNAME")) == (None, None)  # set only while serving


class _PicklesOnce(WorkerSource):
    """A source that can be sent to one worker only: the second worker's start fails."""

    sent = 0

    def __reduce__(self):
        type(self).sent += 1
        if type(self).sent > 1:
            raise pickle.PicklingError("this source cannot be sent twice")
        return (WorkerSource, ())


def _idle_worker(*args) -> None:
    time.sleep(120)


def _tp_children() -> list:
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.name.startswith("tessera-tp-rank")]


@pytest.mark.dist
def test_failed_worker_start_stops_the_workers_started_before():
    _PicklesOnce.sent = 0
    with pytest.raises(pickle.PicklingError, match="cannot be sent twice"):
        WorkerGroup(3, EngineConfig(tensor_parallel_size=3), _PicklesOnce(), target=_idle_worker)
    assert not _tp_children()
    assert not torch.distributed.is_initialized()


@pytest.mark.dist
def test_interrupted_step_fails_later_calls_at_once(llama):
    """Ctrl-C inside a step leaves the worker in a collective rank 0 has left: the group is
    marked failed, so the next call raises at once instead of joining the wrong collective."""
    path, _ = llama
    llm = LLM(path, tensor_parallel_size=2, block_size=4)
    procs = list(llm.engine.executor.workers.procs)
    thread = None
    try:
        assert llm.generate(["hi"], GREEDY)[0].finish_reason == "length"
        armed = [True]

        def interrupt(module, args):
            if armed.pop() if armed else False:
                raise KeyboardInterrupt

        llm.engine.model.layers["1"].attention.wo.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["hi"], GREEDY)
        result = []

        def later():
            try:
                llm.generate(["hi"], GREEDY)
            except BaseException as e:
                result.append(e)

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the call after the interruption hangs"
        assert isinstance(result[0], WorkerFailure) and "interrupted on rank 0" in str(result[0])
        assert llm.engine.failure is result[0]
    finally:
        for p in procs:  # a hung worker would keep close() waiting
            if thread is not None and thread.is_alive():
                p.kill()
        t = time.monotonic()
        llm.close()
    assert time.monotonic() - t < 10
    assert not [p for p in procs if p.is_alive()]


@pytest.mark.dist
def test_dropped_llm_stops_its_workers(llama):
    path, _ = llama
    llm = LLM(path, tensor_parallel_size=2, block_size=4)
    want = llm.generate(["hi"], GREEDY)[0].token_ids
    procs = list(llm.engine.executor.workers.procs)
    del llm
    gc.collect()
    deadline = time.monotonic() + HANG_S
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if p.is_alive()]
    assert not torch.distributed.is_initialized()
    with LLM(path, tensor_parallel_size=2, block_size=4) as again:  # the process can serve again
        assert again.generate(["hi"], GREEDY)[0].token_ids == want


@pytest.mark.dist
def test_health_is_503_naming_the_rank_after_a_worker_died(llama):
    from tessera.infer import LLMEngine

    path, _ = llama
    engine = LLMEngine.from_dir(path, EngineConfig(tensor_parallel_size=2, block_size=4))
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    try:
        with RunningServer(engine, name="tiny") as server:
            assert httpx.get(server.url + "/health").status_code == 200
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S).status_code == 200
            engine.executor.workers.procs[0].kill()
            deadline = time.monotonic() + HANG_S  # seen while idle: no request needed
            while (r := httpx.get(server.url + "/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert r.status_code == 503 and "tensor-parallel rank 1 exited" in r.json()["error"]["message"]
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S)
            assert r.status_code == 500 and "rank 1" in r.text
    finally:
        engine.close()


def test_ranks_get_consecutive_gpus_that_must_exist():
    assert rank_device("cuda:1", 0) == torch.device("cuda", 1)
    assert rank_device("cuda:1", 1) == torch.device("cuda", 2)
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("cpu", 1) == torch.device("cpu")
    check_device_count("cuda:1", 2, 3)
    check_device_count("cpu", 8, 0)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 on device='cuda:1' needs GPUs cuda:1..cuda:2 .*"
                                          r"has 2; use at most tensor_parallel_size=1"):
        check_device_count("cuda:1", 2, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 on device='cuda'.*has 2"):
        check_device_count("cuda", 4, 2)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_tied_bias", "mistral", "qwen2", "qwen3", "qwen2_moe", "deepseek_v3",
                                    "smollm3", "glm4_moe", "gpt_oss",
                                    "seed_oss", "exaone4", "llama4_text",
                                    "gemma3_text"])
def test_two_ranks_match_hf_for_every_family(family, tmp_path):
    """Tied embeddings with attention biases, sliding windows, QKV biases, QK norms, shared
    experts and latent attention (MLA), each split over two ranks: greedy tokens as HuggingFace."""
    from tests.infer.tiny_models import save_tokenizer
    from tests.models.hf_families import hf_configs, random_hf_model

    hf = random_hf_model(hf_configs()[family], 0, 0.25)
    hf.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    prompts = [[0, 5, 17, 33, 2, 9, 40, 41, 42, 43, 44], [0, 70], [0] + list(range(3, 30))]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with LLM(tmp_path, tensor_parallel_size=2, **OPTIONS) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == want
        # sliding-window and chunked layers serve from a pool of their own on both ranks (window_blocks.py)
        window = two.engine.blocks.window
        assert (window is not None) == (family in WINDOWED)
        if window is not None:
            assert window.num_free_blocks == window.num_blocks


WINDOWED = ("mistral", "gpt_oss", "exaone4", "llama4_text", "gemma3_text")


@pytest.mark.slow
def test_two_ranks_match_hf_for_phi3(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj, read as each rank's rows of them, with partial
    rotary and LongRoPE's long table (every prompt is past its original length of 2)."""
    from tests.infer.tiny_models import write_model

    hf = write_model(tmp_path, "phi3", std=0.25)
    prompts = [[0, 5, 17, 33, 2, 9, 40, 41, 42, 43, 44], [0, 70, 71], [0] + list(range(3, 30))]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with LLM(tmp_path, tensor_parallel_size=2, **OPTIONS) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == want

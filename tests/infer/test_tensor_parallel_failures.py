"""Tensor-parallel serving on CPU over gloo when something goes wrong: a worker that fails at start or
dies while serving makes rank 0 fail naming it instead of hanging, and a server whose ranks failed
says so on /health and exits 1; Ctrl-C lets the request in flight finish; the ranks talk over
loopback only; an interrupted step, a failed start or a dropped `LLM` leaves nothing hung or running."""

import gc
import os
import pickle
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tessera.config.hf_config import read_hf_config
from tessera.infer import LLM, SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.runner.tensor_parallel import serving_dims
from tessera.infer.runner.tp_workers import WorkerFailure, WorkerGroup, WorkerSource
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tp_processes import children, serve_two_ranks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


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
    proc, url = serve_two_ranks(path, start_new_session=True)
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
    proc, _ = serve_two_ranks(path)
    try:
        workers = [c for c in children(proc.pid)
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

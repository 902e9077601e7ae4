"""The worker processes of tensor-parallel serving: start, rendezvous, failure, stop.

The process that serves (where `LLM` or the HTTP server lives) is rank 0. It opens a TCP store
listening on 127.0.0.1 only (a free port; the store has no authentication, so it must not be
reachable from other machines), starts ranks 1..N-1 with the "spawn" start method (a fresh
interpreter: safe with CUDA and with the parent's threads; it costs the interpreter's start and
imports, a few seconds, and the calling script needs the `if __name__ == "__main__":` guard), and
every rank joins one process group (gloo on CPU, NCCL on GPUs with rank r on cuda:B+r for
`device="cuda:B"`) plus a gloo control group for the step messages (`tp_channel.py`). All
ranks are on this machine, so gloo and NCCL are told to use the loopback interface too
(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless already set).

Start-up never blocks on a rank that has died: each worker first marks itself `joined/r` in the
store, later `ready/r` (its shard loaded, its KV cache allocated) or `error/r` with its
traceback; rank 0 polls those keys and the processes, and a rank that reports an error or exits
makes start-up fail with `WorkerFailure` naming the rank. While serving, a collective that fails
because a worker died or raised (the worker writes `error/r` before it exits) becomes the same
error; the model group has a timeout, so a rank that hangs fails the step instead of blocking.
Idle workers wait on the control group, whose timeout is long, and exit when rank 0 sends STOP
or goes away (their broadcast then fails). A step interrupted on rank 0 (Ctrl-C) leaves the ranks
out of step, so it too marks the group failed. The workers are stopped by `stop()`, and also when
the group is garbage-collected or the interpreter exits (a finalizer), so an `LLM` dropped
without `close()` leaves no processes or process group behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.checkpoint.loading import load_model
from tessera.config.errors import ConfigError, TesseraError
from tessera.config.model import ModelConfig
from tessera.infer.config import EngineConfig
from tessera.infer.runner.paged_model import build_paged_model
from tessera.infer.runner.tensor_parallel import cut_for_serving, serving_dims, serving_shard_from_hf
from tessera.infer.runner.tp_channel import STOP, StepChannel, serve_worker_steps
from tessera.models.transformer import Transformer

log = logging.getLogger("tessera.infer")

START_TIMEOUT_S = 300.0  # spawning, importing torch and loading a shard
COLLECTIVE_TIMEOUT_S = 300.0  # one step's collectives (a rank that hangs longer fails the step)
IDLE_TIMEOUT = timedelta(days=365)  # workers wait this long for the next step


class WorkerFailure(TesseraError, RuntimeError):
    """A tensor-parallel rank failed to start, raised, or died. `rank` names it; `detail` holds the
    rank's own traceback (logged by rank 0, never put into the message, which reaches HTTP clients)."""

    def __init__(self, message: str, rank: int | None = None, detail: str = ""):
        super().__init__(message)
        self.rank, self.detail = rank, detail


@dataclass
class WorkerSource:
    """What a worker loads: a HuggingFace directory (its own slices only), a directory loaded
    whole then cut (Tessera checkpoints), or the full weights of a model in memory."""

    path: str | None = None
    sliced: bool = False
    cfg: ModelConfig | None = None
    state: dict | None = None


def rank_device(device: str, rank: int) -> torch.device:
    """The device of rank `rank` when serving on `device`: "cuda:B" puts rank r on cuda:B+r
    ("cuda" is cuda:0); any other device is shared by every rank."""
    d = torch.device(device)
    return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d


def check_device_count(device: str, tp: int, count: int) -> None:
    """ConfigError if `tp` ranks from `device` on need more GPUs than the `count` there are."""
    d = torch.device(device)
    if d.type != "cuda":
        return
    first = d.index or 0
    if first + tp > count:
        raise ConfigError(f"tensor_parallel_size={tp} on device={device!r} needs GPUs cuda:{first}.."
                          f"cuda:{first + tp - 1} (one per rank) but this machine has {count}; use at most "
                          f"tensor_parallel_size={max(count - first, 0)} from there, or a lower device index")


def _device(config: EngineConfig, rank: int) -> torch.device:
    return rank_device(config.device, rank)


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (Linux: "lo"), None if there is none by that name."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return "lo" if "lo" in names else None


def _use_loopback() -> list[str]:
    """Point gloo and NCCL at the loopback interface (all ranks are local), except where the
    user chose an interface; returns the variables set here, to be removed again."""
    lo = loopback_interface()
    if lo is None:
        return []
    chosen = [k for k in SOCKET_IFNAME_VARS if k not in os.environ]
    for k in chosen:
        os.environ[k] = lo
    return chosen


def _loopback_store(world: int) -> dist.TCPStore:
    """The master store, listening on 127.0.0.1 only. TCPStore given a host still listens on
    every interface; a socket bound here and handed to it does not (the store then owns it and
    closes it when it goes)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], world, is_master=True,
                              wait_for_workers=False, master_listen_fd=listener.fileno(),
                              timeout=timedelta(seconds=START_TIMEOUT_S))
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store


def _load_rank_model(source: WorkerSource, dims, config: EngineConfig, device: torch.device) -> Transformer:
    dtype = config.torch_dtype
    if source.sliced:
        return serving_shard_from_hf(source.path, source.cfg, dims, dtype, device)
    if source.state is not None:
        model = Transformer(source.cfg, init_seed=None)
        model.load_state_dict(source.state, assign=True)
        model.reset_rope()
        model = model.to(device)
    else:
        model = load_model(source.path, dtype, device, bool(config.gguf_keep_quantized)).model
    return cut_for_serving(model, dims, config.cpu_prepack)


def _join(rank: int, world: int, store: dist.Store, device: torch.device) -> dist.ProcessGroup:
    """Join the model group and return the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def worker_main(rank: int, world: int, port: int, config: EngineConfig, source: WorkerSource) -> None:
    """Entry point of rank `rank` (> 0): join, load this rank's shard, then mirror rank 0's steps."""
    # Ctrl-C in a terminal, or a SIGTERM to the whole process group, reaches the workers too: rank 0
    # alone decides (it finishes the requests in flight, then sends STOP), so they ignore both.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = _device(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(1)  # N ranks share the cores; more threads than cores is many times slower
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    stage = "start"
    try:
        control = _join(rank, world, store, device)
        dims = serving_dims(source.cfg, world)
        dims.build_mesh(device.type)
        model = _load_rank_model(source, dims, config, device)
        paged, _ = build_paged_model(model, config, None, device)
        store.set(f"ready/{rank}", "1")
        stage = "serving"
        serve_worker_steps(paged, StepChannel(control), model.cfg.vocab_size)
    except BaseException as e:  # reported to rank 0, which names this rank
        try:
            store.set(f"error/{rank}", f"{stage}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:  # rank 0 gone (its store with it): nothing to report to
            os._exit(1)
    dist.destroy_process_group()


class _Ranks:
    """What stopping the workers needs, kept apart from the WorkerGroup so that its finalizer can
    hold it without keeping the group alive."""

    def __init__(self, store: dist.TCPStore, env_set: list[str]):
        self.store, self.env_set = store, env_set
        self.procs: list = []
        self.channel: StepChannel | None = None
        self.failure: WorkerFailure | None = None

    def stop(self) -> None:
        """Send STOP (when the group is healthy), then make sure every worker is gone. A failed
        group's workers may be blocked in a collective of the step that failed: killed at once."""
        healthy = self.channel is not None and self.failure is None
        if healthy:
            try:
                self.channel.send(STOP, [])
            except Exception:  # a worker already gone: it is killed below
                healthy = False
        self.channel = None
        for p in self.procs:
            if p.pid is None:  # never started
                continue
            if healthy:
                p.join(timeout=5.0)
            if p.is_alive():  # workers ignore SIGTERM (see worker_main): killed
                p.kill()
                p.join(timeout=5.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # closes its socket (the process group held it too)
        for k in self.env_set:
            os.environ.pop(k, None)
        self.env_set = []


class WorkerGroup:
    """Ranks 1..N-1 as seen from rank 0: start them, then send them steps (`channel`)."""

    def __init__(self, world: int, config: EngineConfig, source: WorkerSource, target=worker_main):
        if dist.is_initialized():
            raise ConfigError(f"tensor_parallel_size={world} needs a process without a default process group "
                              "(this one already belongs to one); serve from its own process")
        self.world, self.config = world, config
        self.device = _device(config, 0)
        store = _loopback_store(world)
        self.state = _Ranks(store, _use_loopback())  # the workers inherit the variables
        # stops the workers when the group is dropped without stop(), and at interpreter exit
        self._finalizer = weakref.finalize(self, self.state.stop)
        self.started_at = time.monotonic()
        try:
            ctx = mp.get_context("spawn")
            for r in range(1, world):
                p = ctx.Process(target=target, args=(r, world, store.port, config, source), daemon=True,
                                name=f"tessera-tp-rank{r}")
                self.procs.append(p)
                p.start()
            self._wait_for("joined")
            self.state.channel = StepChannel(_join(0, world, store, self.device))
        except BaseException:
            self.stop()
            raise

    @property
    def store(self) -> dist.TCPStore:
        return self.state.store

    @property
    def procs(self) -> list:
        return self.state.procs

    @property
    def channel(self) -> StepChannel | None:
        return self.state.channel

    @property
    def failure(self) -> WorkerFailure | None:
        """What ended this group (None while healthy): a failed step, or a worker that exited while
        the group was idle (seen here, so that /health and `tessera serve` need no request to notice)."""
        state = self.state
        # exitcode polls without blocking (None while running); a rank that failed reported its error
        # to the store before exiting, which _dead() reads first
        if state.failure is None and state.channel is not None and any(p.exitcode is not None for p in state.procs):
            state.failure = self._dead()
        return state.failure

    def _error_of(self, rank: int) -> str | None:
        key = f"error/{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _dead(self) -> WorkerFailure | None:
        """The first rank that reported an error or exited, as a WorkerFailure (None: all alive)."""
        for rank, p in enumerate(self.procs, start=1):
            err = self._error_of(rank)
            if err is not None:
                failure = WorkerFailure(f"tensor-parallel rank {rank} failed: {err.splitlines()[0]}", rank, err)
                log.error("tensor-parallel rank %d failed:\n%s", rank, err)
                return failure
            if not p.is_alive():
                return WorkerFailure(f"tensor-parallel rank {rank} exited with code {p.exitcode}", rank)
        return None

    def _wait_for(self, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        keys = [f"{what}/{r}" for r in range(1, self.world)]
        while not self.store.check(keys):
            dead = self._dead()
            if dead is not None:
                raise dead
            if time.monotonic() > deadline:
                raise WorkerFailure(f"tensor-parallel ranks did not become {what} within {timeout:.0f} s")
            time.sleep(0.02)

    def wait_ready(self) -> None:
        """Block until every worker has its shard and KV cache; raise naming a rank that failed."""
        self._wait_for("ready")
        log.info("%d tensor-parallel ranks ready in %.1f s", self.world, time.monotonic() - self.started_at)

    def guarded(self, fn):
        """Run `fn` (which takes part in collectives with the workers); a failure of a worker
        becomes a WorkerFailure naming it, and every later call fails the same way at once. So
        does a failure on this rank (rank 0), and an interruption (Ctrl-C: re-raised as it is),
        since either leaves the other ranks inside a step that this one has left."""
        if self.failure is not None:
            raise self.failure
        try:
            return fn()
        except Exception as e:
            deadline = time.monotonic() + 5.0  # let the failed rank report or exit
            dead = self._dead()
            while dead is None and time.monotonic() < deadline:
                time.sleep(0.05)
                dead = self._dead()
            self.state.failure = dead or WorkerFailure(
                f"tensor-parallel step failed on rank 0: {type(e).__name__}: {e}", 0)
            raise self.failure from e
        except BaseException as e:
            self.state.failure = WorkerFailure(
                f"tensor-parallel step was interrupted on rank 0 ({type(e).__name__}); the ranks are out of step, "
                "so this engine cannot serve any more: close it and start a new one", 0)
            raise

    def stop(self) -> None:
        """Send STOP (when the group is healthy), then make sure every worker is gone; the
        process group is destroyed and the store closed. Idempotent."""
        self._finalizer()

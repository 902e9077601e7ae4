"""Recording a profile of training steps A..B (`tessera train ... --profile A:B`): wall-clock intervals
of each phase of a step, on every rank, into `run_dir/profile/rank<R>.jsonl` (`tessera profile RUN_DIR`
reads them: tessera.profiling).

    with mark("compute", "forward", microbatch=0):  # a no-op (one global read) unless a step is recorded
        ...

Kinds: `step` (one per step, the whole of it), `data` (reading the batch), `compute` (forward and
backward of each micro-batch), `comm` (each collective, with its process group's name: dp, tp, pp,
ep, cp, ...; `overlapped` when it runs beside compute), `optimizer` (gradient norm and update),
`checkpoint` (a save), `sync` (host synchronisations). Collectives are timed on the profiled steps
only, by wrapping their entry points for the step and putting them back after it (a cost per
collective, none per operator): the process groups' own methods (`ProcessGroupTimer`: what
`torch.distributed`'s functions, FSDP2, the gradient all-reduce, the expert all-to-alls and the
pipeline's sends call) and the functional collectives' operators (`FunctionalCollectiveTimer`:
`torch.ops._c10d_functional.*`, which DTensor's redistributions under tensor and context parallelism
call by name). `CollectiveTimer`, a dispatch mode that sees every operator (a Python call per
operator), is the reference the tests and bench/profile_overhead.py compare them with. On those
steps a collective that returns a pending `Work` or an asynchronous tensor is waited for where it is
issued (a point-to-point send or receive is not: the schedule that posts it waits for it), so that
its time is its own. Outside the window nothing is installed and `mark` returns a shared null context.

A line is `{"step", "kind", "name", "t0", "t1"[, "group", "overlapped"]}` (seconds since the epoch,
so ranks of one machine share a clock); the first line of a file is `{"meta": {...}}`: rank, world,
the window, the layout's sizes, tokens and model FLOPs per step, the peak FLOP/s when known.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.config.errors import ConfigError, require
from tessera.parallel.comm_stats import FUNCTIONAL_KINDS, collective_payload
from tessera.train.run.module_marks import ModuleMarks
from tessera.train.run.torch_trace import TorchTrace

PROFILE_DIR = "profile"  # under run_dir
_NULL = nullcontext()
_ACTIVE: StepRecorder | None = None  # the recorder of the step being profiled, else None
# the names a process group goes by, coarse last (a later name wins when two dims share one group)
GROUP_NAMES = ("dp_shard_mod_ep", "dp_shard_in_ep", "dp_shard_cp", "dp_cp", "dp_replicate", "dp_shard", "dp",
               "ep", "cp", "tp", "pp")
_P2P = {"send", "recv_", "recv_any_source_"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}


def parse_window(text: str) -> tuple[int, int]:
    """`A:B` (steps A to B, both included, 1 <= A <= B) from `--profile`."""
    first, sep, last = text.partition(":")
    ok = sep == ":" and first.strip().isdigit() and last.strip().isdigit()
    require(ok and 1 <= int(first) <= int(last), "--profile", text,
            "A:B with 1 <= A <= B, the steps to record (e.g. 20:25)", ConfigError, " ")
    return int(first), int(last)


def mark(kind: str, name: str = "", **fields: Any):
    """A context manager recording the block as one interval of `kind` when a step is being profiled."""
    recorder = _ACTIVE
    return _NULL if recorder is None else recorder.interval(kind, name, fields)


def profiling() -> bool:
    return _ACTIVE is not None


class CollectiveTimer(TorchDispatchMode):
    """Times every collective issued on this thread (and in backward) as a `comm` interval of its group."""

    def __init__(self, recorder: StepRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor's collectives come back here as functional ones
        if getattr(func, "namespace", None) not in _COLLECTIVE_NAMESPACES:  # aten, and higher-order operators
            return func(*args, **kwargs)
        name = func._overloadpacket.__name__
        found = collective_payload(func.namespace, name, args)
        if found is None and name not in _P2P:
            return func(*args, **kwargs)
        kind = found[0] if found is not None else "send_recv"
        group = self.recorder.group_of(args)
        t0 = time.time()
        out = run_collective(func, args, kwargs, group, wait=name not in _P2P)
        self.recorder.add("comm", kind, t0, time.time(), group=group, overlapped=False)
        return out


# process-group method -> the collective's kind (comm_stats.KINDS); a method not on this build is skipped
_PG_METHODS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
               "_allgather_base": "all_gather", "all_gather_single": "all_gather",
               "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
               "all_gather_single_coalesced": "all_gather", "reduce_scatter": "reduce_scatter",
               "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
               "reduce_scatter_tensor_coalesced": "reduce_scatter",
               "reduce_scatter_single_coalesced": "reduce_scatter", "alltoall": "all_to_all",
               "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
               "send": "send_recv", "recv": "send_recv", "recv_anysource": "send_recv"}


class ProcessGroupTimer:
    """Times every collective issued through a `ProcessGroup` method (what `torch.distributed`'s
    functions and FSDP2 call) as a `comm` interval of its group, while entered: the methods of the
    class are wrapped on entry and put back on exit, so operators that are not collectives cost nothing.
    The class is the process's: a collective another thread issues meanwhile (a background checkpoint
    save's) is timed as one of the step's too."""

    def __init__(self, recorder: StepRecorder):
        self.recorder = recorder
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> ProcessGroupTimer:
        cls = dist.ProcessGroup
        for method, kind in _PG_METHODS.items():
            if method in vars(cls):
                self.saved[method] = vars(cls)[method]
                setattr(cls, method, self._timed(getattr(cls, method), kind))
        return self

    def __exit__(self, *exc) -> None:
        for method, original in self.saved.items():
            setattr(dist.ProcessGroup, method, original)
        self.saved = {}

    def _timed(self, method, kind: str):
        recorder = self.recorder

        def call(pg, *args, **kwargs):
            group = recorder.groups.get(pg.group_name, "world")
            t0 = time.time()
            out = run_collective(method, (pg, *args), kwargs, group, wait=kind != "send_recv")
            recorder.add("comm", kind, t0, time.time(), group=group, overlapped=False)
            return out

        return call


class FunctionalCollectiveTimer:
    """Times every functional collective called by name from Python (`torch.ops._c10d_functional.X(...)`,
    as DTensor's redistributions and `torch.distributed._functional_collectives` call them) as a `comm`
    interval of the group it names, while entered: the namespaces' operator packets are replaced by
    timed wrappers on entry and put back on exit. A collective issued from C++ (an autograd operator's
    own backward) is not seen; Tessera's layouts issue none."""

    NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")

    def __init__(self, recorder: StepRecorder):
        self.recorder = recorder
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> FunctionalCollectiveTimer:
        for namespace in self.NAMESPACES:
            ops = getattr(torch.ops, namespace)
            for name, kind in FUNCTIONAL_KINDS.items():
                try:
                    packet = getattr(ops, name)
                except (AttributeError, RuntimeError):  # not an operator of this build
                    continue
                self.saved.append((ops, name, packet))
                setattr(ops, name, self._timed(packet, kind))
        return self

    def __exit__(self, *exc) -> None:
        for ops, name, packet in self.saved:
            setattr(ops, name, packet)
        self.saved = []

    def _timed(self, packet, kind: str):
        recorder, wait_tensor = self.recorder, torch.ops._c10d_functional.wait_tensor

        def call(*args, **kwargs):
            if torch.compiler.is_compiling():  # traced into a compiled graph: no host time of its own
                return packet(*args, **kwargs)
            group = recorder.group_of((*args, *kwargs.values()))
            t0 = time.time()
            out = packet(*args, **kwargs)
            for tensor in out if isinstance(out, tuple | list) else (out,):
                wait_tensor(tensor)
            recorder.add("comm", kind, t0, time.time(), group=group, overlapped=False)
            return out

        return call


def run_collective(func, args: tuple, kwargs: dict, group: str, wait: bool):
    """Issue one collective and, unless `wait` is false, wait for it to complete."""
    out = func(*args, **kwargs)
    if not wait:
        return out
    if isinstance(out, torch.Tensor) and func.namespace != "c10d":  # functional: an async tensor
        torch.ops._c10d_functional.wait_tensor(out)
    else:
        for item in out if isinstance(out, tuple | list) else (out,):
            if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
                item.wait()
    return out


class StepRecorder:
    """This rank's recorder of the steps of the window: intervals buffered in memory during a step,
    appended to the rank's file when the step ends."""

    def __init__(self, run_dir: Path, window: tuple[int, int], rank: int, world: int, meta: dict[str, Any],
                 groups: dict[str, str] | None = None, collectives: bool = True, modules: list[Any] | None = None,
                 torch_trace: bool = False):
        """`collectives`: time them (not in one process, where there are none), by wrapping the process
        groups' methods and the functional collectives' operators (`dispatch_mode`, set afterwards: by
        the reference dispatch mode instead, as the tests and the bench compare them); `modules`: the
        model's parts on this rank, their attention, MLP, norm and LM-head modules timed by kind
        (module_marks.py; None: not); `torch_trace`: torch.profiler over the window too (torch_trace.py)."""
        self.first, self.last = window
        self.path = Path(run_dir) / PROFILE_DIR / f"rank{rank}.jsonl"
        self.groups = groups or {}  # process-group name -> the layout's name for it
        self.meta = {"rank": rank, "world": world, "window": [self.first, self.last], **meta}
        self.lines: list[dict[str, Any]] = []
        self.step = 0
        self.collectives = collectives
        self.dispatch_mode = False
        self.stages: list[Any] = []  # a pipeline schedule's stages on this rank, their chunks marked (`watch`)
        self.modules = modules or []
        self.marks = ModuleMarks(self.add, cuda=meta.get("device") == "cuda") if modules else None
        self.torch_trace = TorchTrace(self.path.parent / f"torch_rank{rank}.json") if torch_trace else None

    def records(self, step: int) -> bool:
        return self.first <= step <= self.last

    def group_of(self, args: tuple) -> str:
        """The layout's name of the process group a collective's arguments name ("world" for another)."""
        for a in args:
            if isinstance(a, str) and a in self.groups:  # functional collectives name their group
                return self.groups[a]
            if isinstance(a, torch.ScriptObject):  # c10d operators take the ProcessGroup, boxed
                try:
                    return self.groups.get(dist.ProcessGroup.unbox(a).group_name, "world")
                except RuntimeError:  # another boxed argument (the reduce op)
                    continue
        return "world"

    def add(self, kind: str, name: str, t0: float, t1: float, **fields: Any) -> None:
        self.lines.append({"step": self.step, "kind": kind, "name": name, "t0": t0, "t1": t1, **fields})

    @contextmanager
    def interval(self, kind: str, name: str, fields: dict[str, Any]) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.add(kind, name, t0, time.time(), **fields)

    @contextmanager
    def step_block(self, step: int) -> Iterator[None]:
        """Step `step` recorded when it is in the window (collectives timed, markers on), else as is."""
        global _ACTIVE
        if not self.records(step):
            yield
            return
        self.step, _ACTIVE = step, self
        self._watch(True)
        if self.torch_trace is not None:
            self.torch_trace.start()
        t0 = time.time()
        try:
            with self._collective_timers():
                yield
        finally:
            self._watch(False)
            _ACTIVE = None
            self.add("step", f"step {step}", t0, time.time())
            self._flush(first=step == self.first)
            if self.torch_trace is not None and step == self.last:
                self.torch_trace.stop()  # its file written outside the step it would lengthen

    def _collective_timers(self) -> ExitStack:
        """The timers of the step's collectives, entered together (none in one process)."""
        stack = ExitStack()
        if not self.collectives:
            return stack
        timers = [CollectiveTimer(self)] if self.dispatch_mode else \
            [ProcessGroupTimer(self), FunctionalCollectiveTimer(self)]
        for timer in timers:
            stack.enter_context(timer)
        return stack

    def close(self) -> None:
        """The end of training: a torch.profiler trace still open (the run ended inside the window) written."""
        if self.torch_trace is not None:
            self.torch_trace.stop()

    def _watch(self, on: bool) -> None:
        """While a step is recorded, each pipeline stage's forward and backward of a micro-batch (the
        methods its schedule calls) is a `compute` interval, and the model's modules are timed by kind
        (module_marks.py); the instance's own attribute and the hooks are dropped afterwards, so the
        stages and modules are as they were."""
        if self.marks is not None and on:
            self.marks.install(self.modules)
        elif self.marks is not None:
            self.marks.remove()
        for stage in self.stages:
            for method, name in _CHUNKS.items():
                if not hasattr(type(stage), method):
                    continue
                if on:
                    setattr(stage, method, _marked(getattr(stage, method), name))
                else:
                    stage.__dict__.pop(method, None)

    def _flush(self, first: bool) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w" if first else "a") as f:
            if first:
                f.write(json.dumps({"meta": self.meta}) + "\n")
            f.writelines(json.dumps(line) + "\n" for line in self.lines)
        self.lines = []


_CHUNKS = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
           "backward_weight_one_chunk": "backward weight"}


def _marked(method, name: str):
    def call(*args, **kwargs):
        with mark("compute", name, microbatch=args[0] if args and isinstance(args[0], int) else None):
            return method(*args, **kwargs)

    return call


def pipeline_stages(engine) -> list[Any]:
    """The stages of a pipeline step engine's schedule on this rank (none for another engine)."""
    schedule = getattr(getattr(engine, "run", None), "schedule", None)
    stages = getattr(schedule, "_stages", None)
    if stages is None and getattr(schedule, "_stage", None) is not None:
        stages = [schedule._stage]
    return list(stages or [])


def group_names(dims) -> dict[str, str]:
    """Process-group name -> the layout's dimension name (dp, tp, pp, ep, cp, ...) of a built mesh."""
    if dims is None or dims.mesh is None:
        return {}
    out: dict[str, str] = {}
    for name in GROUP_NAMES:
        if dims.size(name) > 1:
            out[dims[name].get_group().group_name] = "dp" if name.startswith("dp") and name != "dp_cp" else name
    return out


def recorder_for(window: tuple[int, int] | None, cfg, layout, flops_per_token: float,
                 peak_flops: float | None, engine: Any = None, compiled: bool = False,
                 torch_trace: bool = False) -> StepRecorder | None:
    """The trainer's recorder for `--profile A:B` (None without one): what the analysis needs to know
    of the run beside the intervals goes in the files' first line. Under `compiled` blocks the
    modules are not timed by kind (hooks would change the compiled graphs)."""
    if window is None:
        return None
    t, dims = cfg.train, layout.dims
    sizes = {d: (dims.size(d) if dims is not None else 1) for d in ("pp", "dp", "tp", "cp", "ep")}
    microbatches = cfg.parallel.microbatches or t.global_batch_size // (t.micro_batch_size * sizes["dp"])
    meta = {"sizes": sizes, "microbatches": microbatches, "pp_schedule": cfg.parallel.pp_schedule,
            "tokens_per_step": t.global_batch_size * t.seq_len, "flops_per_token": flops_per_token,
            "peak_flops": peak_flops, "device": layout.device.type}
    modules = None if compiled else list(getattr(engine, "parts", None) or [])
    recorder = StepRecorder(Path(cfg.run_dir), window, layout.rank, layout.world_size, meta, group_names(dims),
                            collectives=layout.distributed, modules=modules, torch_trace=torch_trace)
    recorder.stages = pipeline_stages(engine)
    return recorder

"""Crash-safe distributed checkpoints with `torch.distributed.checkpoint` (DCP).

Layout of a run's checkpoint directory:

    checkpoints/
      step_00000200/     DCP files (.metadata, __*.distcp) + meta.json (written last)
      step_00000300/
      latest             text file: the name of the newest complete checkpoint

DCP stores every tensor by its fully qualified name with its global shape, so a later run can
load it under another parallel layout (sharded or not). It also runs in a single process
without `init_process_group` (it then plans and writes as rank 0 alone). With several ranks,
saving and loading are collective: every rank calls them, and rank 0 alone does the directory
bookkeeping below.

A save goes to `.tmp-step_N-PID/`, gets `meta.json`, is renamed to `step_N/`, and only then is
`latest` replaced (`os.replace`, atomic). A crash at any point leaves the previous checkpoint and
pointer intact; leftovers of an interrupted save are removed by `remove_partial_saves`. Old
checkpoints beyond `keep_last` are deleted after the pointer moved.

meta.json records the size and CRC-32 of every file (checksums.py): `find_latest_good` skips a
checkpoint whose files were truncated, corrupted or lost afterwards, naming the file, and
`verified` refuses one. Loading never unpickles arbitrary objects (reader.py): a `latest`
pointer or meta.json that is damaged, or DCP metadata naming anything but plain data, is a
CheckpointError.

Test hook: if the environment variable TESSERA_TEST_PAUSE_IN_SAVE is "STEP:SECONDS", the save
of step STEP prints `tessera-test-hook: paused in save` to stderr and sleeps SECONDS after the
DCP files are in the temporary directory and before it is completed, so a test can kill the
process in the middle of a save deterministically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tessera.checkpoint.dcp.checksums import DCP_METADATA, FILES_KEY, digest_rank_files, file_digest, verify_files
from tessera.config.errors import CheckpointError
from tessera.config.json_text import read_json_file

if TYPE_CHECKING:
    from torch.distributed.checkpoint import SavePlanner

# torch.distributed.checkpoint (and reader.py, built on it) is imported where a checkpoint is saved or
# loaded: it brings DTensor, sympy and torch's symbolic shapes (about 45 MiB resident), which a server
# that only asks whether a path is a checkpoint (checkpoint/loading.py) need not hold.

LATEST = "latest"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_\d+$")
PAUSE_HOOK_ENV = "TESSERA_TEST_PAUSE_IN_SAVE"
FULL_DISK_BYTES = 2**20  # less free space than this after a failed write: the disk is what is full

_SINGLE_PROCESS_WARNING = ".*torch.distributed is disabled, unavailable or uninitialized.*"


@contextmanager
def _quiet_single_process():
    """DCP warns that it runs as one process when no process group exists; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    """A checkpoint directory whose save finished: DCP metadata and meta.json are both there."""
    return (path / DCP_METADATA).is_file() and (path / META).is_file()


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` as (step, path), oldest first."""
    root = Path(root)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit() and is_complete(p):
                out.append((int(p.name[5:]), p))
    return sorted(out)


def find_latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    root = Path(root)
    named = _pointer_target(root)
    if named is not None and is_complete(named):
        return named
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def _pointer_target(root: Path) -> Path | None:
    """The checkpoint `latest` names; None when it is absent or damaged (not a `step_N` name in `root`),
    in which case the newest complete checkpoint is the one to use."""
    try:
        name = (root / LATEST).read_bytes()[:64].decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / name if _STEP_DIR.match(name) else None


def checkpoint_problem(path: Path) -> str | None:
    """None when checkpoint `path` can be trusted to load: meta.json readable, every file recorded in it
    present with its size and checksum, DCP metadata plain data. Else what is wrong, naming the file.
    Checkpoints written before checksums were recorded are checked for the rest only."""
    try:
        meta = read_meta(path)
        problem = verify_files(path, meta[FILES_KEY]) if FILES_KEY in meta else None
        if problem is None:
            from tessera.checkpoint.dcp.reader import read_dcp_metadata

            read_dcp_metadata(path)
        return problem
    except CheckpointError as e:
        return str(e)


def find_latest_good(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` that passes `checkpoint_problem`, newest first from the
    one `latest` names; and one line for each newer one that was skipped, naming it and the file."""
    root = Path(root)
    candidates = [p for _, p in reversed(list_checkpoints(root))]
    named = _pointer_target(root)
    if named in candidates:  # the pointer wins over a newer directory left by a save that never completed
        candidates = candidates[candidates.index(named):]
    skipped = []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(f"checkpoint {str(path)!r} is damaged: {problem}")
    return None, skipped


def verified(path: Path) -> Path:
    """`path` if `checkpoint_problem` finds nothing wrong with it, else a CheckpointError saying what."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {problem}; load an earlier step_* "
                              "directory of the run instead")
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from a checkpoint, a `checkpoints/` root or a run directory."""
    p = Path(path)
    if is_complete(p):
        return p
    for root in (p, p / "checkpoints"):
        found = find_latest(root)
        if found is not None:
            return found
    raise CheckpointError(f"no complete checkpoint at {str(p)!r} (looked for {META} and {DCP_METADATA} in "
                          f"it, in its step_* directories and in {str(p / 'checkpoints')!r})")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON written next to the DCP files (step, model config, format, file checksums)."""
    f = Path(path) / META
    meta = read_json_file(f, CheckpointError, f"{str(f)!r} (the checkpoint is damaged)")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(f)!r} holds a JSON {type(meta).__name__}, not an object; the checkpoint "
                              "is damaged")
    return meta


def remove_partial_saves(root: str | os.PathLike) -> list[Path]:
    """Delete temporary directories left by interrupted saves; returns what was removed.

    A complete checkpoint moved aside to be replaced by a new save of the same step (`.old-*`)
    goes back into place if the crash came before the new one took its name.
    """
    root = Path(root)
    removed = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith(".old-"):
                original = root / p.name[len(".old-"):].rsplit("-", 1)[0]
                if not original.exists() and is_complete(p):
                    os.rename(p, original)
                    continue
            if p.name.startswith(".tmp-") or p.name.startswith(".old-"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _pause_hook(step: int) -> None:
    spec = os.environ.get(PAUSE_HOOK_ENV)
    if spec:
        at, _, seconds = spec.partition(":")
        if int(at) == step:
            print(f"tessera-test-hook: paused in save of step {step}", file=sys.stderr, flush=True)
            time.sleep(float(seconds or 3600))


def _world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in `group` (None: the default process group); (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def save_checkpoint(root: str | os.PathLike, step: int, state: dict[str, Any], meta: dict[str, Any],
                    keep_last: int, planner: SavePlanner | None = None,
                    group: dist.ProcessGroup | None = None) -> Path:
    """Save `state` (a DCP state dict: tensors and plain data) as checkpoint `step`.

    Returns the final directory. `meta` (JSON-able) is stored as meta.json together with the step
    and the checksums of every file (checksums.py). With several ranks every rank calls this: each
    writes its shards into one temporary directory (on a file system all ranks share) and hashes
    them, then rank 0 alone completes it (meta.json, rename, pointer, old checkpoints), and every
    rank returns once that is done or raises if it failed. A failed save (a full disk, a read-only
    file system) raises CheckpointError and leaves the previous checkpoint and pointer as they were.
    `planner` replaces DCP's default save planner (layout.py writes chunks it reads lazily). Every
    collective of the save runs in `group` (None: the default group; a background save has its own,
    background.py), whose rank 0 completes the directory.
    """
    root = Path(root)
    final = root / step_dir_name(step)
    rank, world = _world(group)
    tmp, error = None, None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".tmp-{final.name}-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
        except OSError as e:
            error = _save_error(final, e)
    if world > 1:
        tmp, error = _broadcast_from_rank0((str(tmp) if tmp is not None else None, error), group)
    if error is not None:
        raise CheckpointError(error)
    tmp = Path(tmp)
    files, error = _save_shards(state, tmp, final, rank, planner, group)
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (files, error), group=group)
        error = next((err for _, err in gathered if err is not None), None)
        files = {k: v for f, _ in gathered if f for k, v in f.items()}
    if rank == 0:
        if error is None:
            try:
                files[DCP_METADATA] = file_digest(tmp / DCP_METADATA)
                _pause_hook(step)
                _complete(root, tmp, final, step, {**meta, FILES_KEY: files}, keep_last)
            except OSError as e:
                error = _save_error(final, e)
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if world > 1:
        error = _broadcast_from_rank0(error, group)
    if error is not None:
        raise CheckpointError(error)
    return final


def _save_shards(state: dict[str, Any], tmp: Path, final: Path, rank: int, planner, group):
    """This rank's shards of `state` written into `tmp` by DCP: (their checksums, None), or (None, why not)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            dcp.save(state, checkpoint_id=str(tmp), planner=planner, process_group=group)
        return digest_rank_files(tmp, rank), None
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        return None, _save_error(final, e)


def _failure_reason(e: BaseException) -> str:
    """The cause of a failed DCP save or load in a few words (the OS error and its file when there is one)."""
    from torch.distributed.checkpoint.api import CheckpointException

    cause: BaseException = e
    if isinstance(e, CheckpointException):  # DCP wraps each rank's failure; name the first
        failures = list(getattr(e, "failures", {}).values())
        first = failures[0][0] if failures and isinstance(failures[0], tuple) else None  # (exception, stack)
        cause = first if isinstance(first, BaseException) else e
    if isinstance(cause, CheckpointError):
        return str(cause)
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror + (f" ({cause.filename})" if cause.filename else "")
    return f"{type(cause).__name__}: " + " ".join(str(cause).split())[:300]


def _save_error(final: Path, e: BaseException) -> str:
    """One line for a failed save: what failed and that the previous checkpoint is untouched. A
    writer that does not pass the OS error on (torch.save's "unexpected pos") says no more than that
    a write came up short: when the file system is (nearly) full, the line says so."""
    reason = _failure_reason(e)
    if "No space left" not in reason:
        try:
            free = shutil.disk_usage(final.parent).free
        except OSError:
            free = None
        if free is not None and free < FULL_DISK_BYTES:
            reason += f" (No space left on device: {free:,} bytes free)"
    return (f"cannot save checkpoint {str(final)!r}: {reason}; the previous checkpoint and the "
            f"{LATEST} pointer are unchanged")


def _complete(root: Path, tmp: Path, final: Path, step: int, meta: dict[str, Any], keep_last: int) -> None:
    """meta.json into the saved directory, then rename it into place, move `latest`, prune old ones."""
    _write_durably(tmp / META, json.dumps({"step": step, "format": 1, **meta}, indent=1))
    _fsync_dir(tmp)
    old = None
    if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer_tmp = root / f".tmp-{LATEST}-{os.getpid()}"
    _write_durably(pointer_tmp, final.name + "\n")
    os.replace(pointer_tmp, root / LATEST)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for _, p in list_checkpoints(root)[:-keep_last]:
        if p != final:
            shutil.rmtree(p, ignore_errors=True)


def checkpoint_tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...] | None]:
    """Every stored key with its global shape (None for non-tensor objects), from DCP metadata."""
    from tessera.checkpoint.dcp.reader import read_dcp_metadata

    md = read_dcp_metadata(path)
    return {k: tuple(v.size) if hasattr(v, "size") else None for k, v in md.state_dict_metadata.items()}


def check_compatible(path: str | os.PathLike, prefix: str, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError naming the first key of `expected` (under `prefix.`) that the
    checkpoint lacks or stores with another shape, or the first stored key `expected` lacks."""
    stored = checkpoint_tensor_shapes(path)
    here = {k[len(prefix) + 1:]: v for k, v in stored.items() if k.startswith(prefix + ".")}
    for key, shape in expected.items():
        if key not in here:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: it has no {key!r}")
        if here[key] is not None and tuple(here[key]) != tuple(shape):
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {key!r} has shape "
                                  f"{list(here[key])} there but {list(shape)} in the model")
    extra = sorted(set(here) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: it has {extra[0]!r}, "
                              f"which the model lacks ({len(extra)} such keys)")


def load_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> int:
    """Load the keys of `state` from checkpoint `path` in place (tensors copied into, objects replaced);
    returns the bytes this rank read from the files (only the stored chunks its tensors overlap).

    Nothing in the files is unpickled beyond plain data (reader.py)."""
    from tessera.checkpoint.dcp.reader import SafeLoadPlanner

    return _load(path, state, SafeLoadPlanner(), no_dist=False)


def load_boxes(path: str | os.PathLike, boxes: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> int:
    """For each stored key, copy the box of its tensor that starts at the given offsets and has the
    given tensor's shape into that tensor (cast to its dtype), whatever layout saved it; returns the
    bytes read.

    This process alone reads, even when it belongs to a process group (the other ranks need not
    take part), and only the stored shards that overlap a box."""
    from tessera.checkpoint.dcp.reader import BoxLoadPlanner

    planner = BoxLoadPlanner({key: offsets for key, (offsets, _) in boxes.items()})
    return _load(path, {key: t for key, (_, t) in boxes.items()}, planner, no_dist=True)


def _load(path: str | os.PathLike, state: dict[str, Any], planner, no_dist: bool) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tessera.checkpoint.dcp.reader import SafeFileSystemReader

    reader = SafeFileSystemReader(str(path))
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot load checkpoint {str(path)!r}: {_failure_reason(e)}") from e
    return reader.bytes_read

"""Building the CPU library with PyTorch's extension builder, where a killed build cannot stall the next.

`torch.utils.cpp_extension.load` guards its build directory with a `lock` file (torch.utils.file_baton:
created with O_EXCL, removed when the build ends); a process killed while compiling (SIGKILL, the OOM
killer, a machine that lost power) leaves it behind, and every later `load` waits for it to vanish,
forever and without a word. So Tessera builds under a lock of its own beside it, `tessera.lock`, held
with `fcntl.flock`, which the kernel releases when its holder dies however it dies: whoever holds it
is the only Tessera process building in that directory, so a `lock` file found then was left by a
dead build, and is removed with one log line. Waiting for a live builder is one log line too, naming
its pid, and so is a build that is about to start (it takes minutes on a small machine). Torch is
imported only to build: taking the lock needs none.

The directory's name carries a short hash of the checkout's `csrc` folder (its absolute path): two
clones on one machine build into two directories instead of rebuilding each other's library in turn
(ninja rebuilds whenever the sources' paths in build.ninja change).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# not under "tessera.infer": `tessera generate` keeps the engine's warnings quiet, not what a build says
log = logging.getLogger("tessera.build")

BATON = "lock"  # the file torch.utils.file_baton.FileBaton leaves when its process dies mid-build
OURS = "tessera.lock"  # held with flock while a Tessera process builds; holds the holder's pid


def library_name(prefix: str, csrc: Path) -> str:
    """`prefix` and a short hash of `csrc`'s absolute path: one build directory per checkout."""
    return f"{prefix}_{hashlib.sha256(str(csrc.resolve()).encode()).hexdigest()[:8]}"


def build_directory(name: str) -> Path:
    """Where PyTorch's builder would build `name`: `TORCH_EXTENSIONS_DIR/name`, else its default root
    (~/.cache/torch_extensions/py<version>_<accelerator>/name). Given to `load` explicitly, so the
    lock taken here is always the one beside torch's."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                       f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name


def _hold(f, path: Path) -> bool:
    """Take the flock on open file `f` (Tessera's lock at `path`), waiting with one log line for a
    live holder; False where the file system has no locks (some network mounts)."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        log.warning("waiting for process %s, which is building the CPU kernels in %s", holder, path.parent)
        fcntl.flock(f, fcntl.LOCK_EX)
    except OSError as e:
        log.warning("cannot lock %s (%s): a build lock left there by a killed build would not be taken over",
                    path, e)
        return False
    return True


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold `directory`'s Tessera lock (waiting, with one log line, for a live builder), removing a
    stale `lock` of PyTorch's builder found once it is held."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / OURS, "a+") as f:
        if not _hold(f, directory / OURS):
            yield  # PyTorch's own lock only, as without this module
            return
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        stale = directory / BATON
        if stale.exists():
            log.warning("taking over the build lock %s: the build that left it was killed (no process is "
                        "building there now)", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            f.truncate(0)  # the flock goes with the file's closing


def needs_build(directory: Path, name: str, inputs: list[Path]) -> bool:
    """Whether `name`'s library in `directory` is missing or older than one of `inputs` (what ninja
    will rebuild, but for a change of flags alone)."""
    library = directory / f"{name}.so"
    try:
        built = library.stat().st_mtime
    except OSError:
        return True
    return any(p.stat().st_mtime > built for p in inputs)


def load_library(name: str, sources: list[Path], headers: list[Path], **build) -> None:
    """Build (if needed) and load the operator library `name` from `sources` under the lock, saying
    in one log line when a build starts; `build`: `load`'s other arguments."""
    from torch.utils.cpp_extension import load

    directory = build_directory(name)
    with build_lock(directory):
        if needs_build(directory, name, [*sources, *headers]):
            log.warning("building the CPU kernels in %s (first use, or their sources changed); this may take "
                        "minutes", directory)
        load(name=name, sources=[str(s) for s in sources], build_directory=str(directory), is_python_module=False,
             verbose=False, **build)

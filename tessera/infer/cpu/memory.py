"""The C library's allocator, told to keep freed memory for the next serving step (CPU, glibc).

A prompt chunk's forward allocates activations of megabytes ([tokens, ffn_dim] and the like) and frees
them by the end of the step. glibc's malloc serves blocks that large with fresh `mmap`s, or trims the
heap's top back to the kernel once a few hundred kilobytes are free; either way the next step touches
new pages, and each first touch is a page fault. Raising the mmap threshold to its maximum (32 MiB on
64-bit) and the trim threshold past anything a step frees keeps those pages in the process, where the
next step's allocations find them: a prompt chunk, whose activations are large, gets faster;
decode steps, whose activations are small, do not change
(docs/benchmarks/2026-11-27-serving-vs-vllm-4-attention-kernel.md, "Freed activations kept"). The
memory kept is the largest step's activations, which the server needs again anyway. The same
reason makes vLLM advise TCMalloc for its CPU backend.

`tessera serve` on CPU calls `keep_freed_memory()` before it loads the model (`--no-cpu-keep-freed`
leaves the allocator as it is); elsewhere, and with another C library, it does nothing.

What a model puts to sleep is another matter: its memory is meant for the other models, and kept
freed pages would stay in the process. `release_freed_memory()` (glibc's `malloc_trim(0)`) gives
the free pages back to the kernel: sleep level 1 calls it once the KV cache is freed
(tessera/infer/engine/sleep.py), and the several-models server after a model is put down to level 2.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("tessera.infer")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: larger values are refused
TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt takes: the heap's top is kept unless 2 GiB of it are free


def keep_freed_memory() -> bool:
    """Set glibc's malloc to serve blocks of up to 32 MiB from the heap and to keep its freed top; True
    when it took effect (False without glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: other C libraries' mallopt take other numbers)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("the C library refused the allocator settings; freed memory goes back as before")
    return bool(ok)


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (glibc's `malloc_trim(0)`), whatever
    `keep_freed_memory` set: after a model's weights were freed to make room. True when
    something was given back; False without glibc."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0) == 1

"""Attention over the paged KV cache read in place, on CPU: a small C++ kernel built at first use.

Every row of a CPU serving step (decodes, speculative tokens to verify, prompt chunks) attends over
its own context (`ragged_attention.py`). Done with PyTorch ops, that is a gather of every row's
blocks into one buffer per layer, then one SDPA per row: at 32 rows of a few hundred tokens the copy
moves as many bytes per step as the model's weights, and the per-row calls cost more in dispatch
than in arithmetic; a prompt chunk after earlier context needs an explicit mask, with which
PyTorch's CPU flash attention computes the whole square of scores (docs/benchmarks.md, "attention of
prompt chunks: the kernel vs SDPA").
The kernel in `csrc/paged_attention_cpu.cpp` reads each row's keys and values where they lie in the
cache, in one call per layer: a short row once per (row, KV head) for all the queries of that head
group (vLLM's CPU backend has a kernel of the same kind), a long one per (row, head) in tiles of
queries over blocks of keys with an online softmax, skipping the keys no query of a tile sees.

It is compiled with `torch.utils.cpp_extension` the first time a CPU server needs it (tens of seconds to
minutes, said in one log line) and cached in `TORCH_EXTENSIONS_DIR` (by default ~/.cache/torch_extensions),
in a directory named by this CPU's vector extensions (AVX2 or AVX-512, read from
`torch.backends.cpu.get_cpu_capability()`) and by a short hash of this checkout's csrc path, so that two
clones on one machine do not rebuild each other's library in turn; a build killed midway leaves no lock
that stalls the next (build.py). Where it cannot be built (no C++ compiler, no ninja) the server logs
why once and attends with the PyTorch ops, which compute the same thing; `TESSERA_CPU_ATTENTION=torch`
chooses them outright. Both are tested against each other and against keys read slot by slot
(tests/infer/test_ragged_attention.py).
An int8 cache (`kv_cache_dtype="int8"`) is read as it lies too: a decode row's products take the int8
keys and values with their per-(token, head) scales, widened in registers, never a dequantized copy of
its blocks (the C++ file's comment).

The same library (`torch.ops.tessera_cpu`) holds the one-pass layer kernels (infer/cpu/layer_ops.py) and
the panel kernel for projections (infer/cpu/linear.py); `library_available()` says whether it can serve
them, and the same switch turns them off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from tessera.infer.cpu.build import library_name, load_library
from tessera.infer.scheduling.kv_cache import PagedKVCache

log = logging.getLogger("tessera.infer")

CSRC = Path(__file__).with_name("csrc")
# one library, torch.ops.tessera_cpu (its ops registered in library.cpp): the attention, the layer ops
# (infer/cpu/layer_ops.py), the projections (infer/cpu/linear.py), GGUF blocks (infer/cpu/gguf_matmul.py), a
# dense layer of them (infer/cpu/gguf_layer.py), the chunked delta rule's chunk terms (infer/cpu/layer_ops.py),
# int8 / int4 codes (infer/cpu/quant_matmul.py)
SOURCES = [CSRC / "library.cpp", CSRC / "paged_attention_cpu.cpp", CSRC / "layer_ops_cpu.cpp", CSRC / "linear_cpu.cpp",
           CSRC / "gguf_matmul_cpu.cpp", CSRC / "gguf_layer_cpu.cpp", CSRC / "delta_rule_cpu.cpp",
           CSRC / "quant_matmul_cpu.cpp"]
ENV = "TESSERA_CPU_ATTENTION"  # "torch": never build or use the kernel


def _vector_flags() -> tuple[str, list[str]]:
    """The kernel's name suffix and compiler flags for this CPU's vector extensions (the build is
    cached per name, so a cache directory shared by different CPUs keeps one build for each)."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return "avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX2":
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


def _find_ninja() -> None:
    """PyTorch's builder runs `ninja` from PATH; the PyPI package (a dependency) puts its binary in the
    environment's bin folder, which is not on PATH when the environment was not activated (`make test`
    runs .venv/bin/python). Appended, so a ninja already on PATH is still the one used."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = path + os.pathsep + ninja.BIN_DIR if path else ninja.BIN_DIR


def library() -> str:
    """The library's name, and its build directory's: this CPU's vector extensions and a short hash
    of this checkout's csrc path (build.library_name)."""
    return library_name(f"tessera_cpu_attention_{_vector_flags()[0]}", CSRC)


@functools.cache
def kernel():
    """The compiled op (`torch.ops.tessera_cpu.paged_attention`; its library holds the other CPU
    kernels too), or None where it cannot be had (the reason is logged once)."""
    try:
        _find_ninja()
        flags = _vector_flags()[1]
        # PyTorch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag
        headers = sorted(CSRC.glob("*.h"))
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:16]
        load_library(library(), SOURCES, headers,
                     extra_cflags=["-O3", "-fopenmp", f"-DTESSERA_HEADERS_{digest}", *flags],
                     extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)])
        return torch.ops.tessera_cpu.paged_attention
    except Exception as e:  # no compiler, no ninja, a failed build: the PyTorch ops serve instead
        log.warning("the CPU kernels could not be built (%s: %s); attending and normalizing with PyTorch ops, "
                    "multiplying with oneDNN's linear",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None


def library_available() -> bool:
    """Whether the library's kernels can be had here: it builds, and `TESSERA_CPU_ATTENTION=torch` is
    not set (read when a model is loaded: the layer and panel kernels are installed then)."""
    return os.environ.get(ENV, "").lower() != "torch" and kernel() is not None


def serves(kv: PagedKVCache) -> bool:
    """Whether the kernel serves every row of a step over cache `kv` (queries in the cache's dtype):
    a cache on CPU (full precision, or int8), a kernel that builds, no `TESSERA_CPU_ATTENTION=torch`."""
    return bool(kv.k) and usable(kv.k[0], torch.empty(0, dtype=kv.dtype))


def usable(kv_store: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel serves a layer whose cache tensor is `kv_store` (the queries' dtype, or int8)
    for queries `q` (read at
    every call, so `TESSERA_CPU_ATTENTION=torch` set in a running process takes effect at once)."""
    if os.environ.get(ENV, "").lower() == "torch":
        return False
    return (kv_store.device.type == "cpu" and kv_store.dtype in (q.dtype, torch.int8)
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and kernel() is not None)

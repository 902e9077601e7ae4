"""Reading a GGUF file (llama.cpp's format) as a HuggingFace config and HuggingFace-named float tensors.

    found = GGUFFile.open("SmolLM2-135M-Instruct.Q4_1.gguf")
    found.hf_config                         # {"model_type": "llama", "hidden_size": 576, ...}
    for hf_name, tensor in found.tensors(): # float32, dequantized, llama.cpp's row order undone
        ...

The file is read with the `gguf` package (llama.cpp's own reader; a dev/optional dependency,
imported only here). What it holds is untrusted input: a file that is not GGUF, a truncated one,
an architecture or a tensor type Tessera does not read, or metadata that is missing a field is one
ConfigError naming the file and what is allowed (the CLI exits 2). Before gguf's reader walks the
metadata, header.py walks it with every count bounded by the file's size (gguf's reader believes
them: 10^9 declared array items would be minutes of work and gigabytes of memory).

Three things differ from a HuggingFace checkpoint:
- Names: `blk.N.attn_q.weight` for `model.layers.N.self_attn.q_proj.weight`, taken from gguf's own
  name tables (`gguf.get_tensor_name_map`), so no table is kept here.
- Values: quantized blocks (Q8_0, Q4_K, ...), dequantized with gguf's `quants.dequantize` into
  float32 (`tensors()`), or, through `stored()`, also given as the raw blocks themselves
  (`StoredTensor.raw_blocks`) for a model that keeps them quantized (load.py's `keep_quantized`).
- Row order: llama.cpp's converter reorders the rows of every LLaMA-architecture query and key
  projection (HuggingFace stores RoPE's two halves of a head apart; GGML's RoPE wants each pair
  adjacent), `permute` below undoes it. Qwen2 files are stored in HuggingFace's order.

- Experts: one [E, out, in] tensor per projection (`ffn_gate_exps`), named for HuggingFace's E
  tensors with `*` for the expert (load.py fills Tessera's stacked tensor with it), or written into
  the columns of a fused HuggingFace tensor (gpt-oss's interleaved gate / up; `Placed`).

What differs between architectures (the per-layer modules, config fields only the metadata of that
architecture holds, Gemma's norm offset, the tensors placed otherwise) is architectures.py's table.

Mistral has no GGUF architecture of its own: llama.cpp writes Mistral models as `llama`, and they
load as the llama family (without a sliding window, as llama.cpp runs them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.checkpoint.gguf.architectures import ARCHITECTURES, Metadata, Placed
from tessera.checkpoint.gguf.header import read_metadata
from tessera.checkpoint.gguf.rope_freqs import llama3_from_rope_freqs
from tessera.config.errors import ConfigError

MAGIC = b"GGUF"

# Tensor types read (each covered by tests/checkpoint/test_gguf.py); gguf's dequantize reads them all.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "MXFP4")

# `{arch}.KEY` metadata -> config.json field; the required ones first.
_REQUIRED = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
             "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
             "attention.layer_norm_rms_epsilon": "rms_norm_eps"}
_OPTIONAL = {"attention.head_count_kv": "num_key_value_heads", "context_length": "max_position_embeddings",
             "rope.freq_base": "rope_theta", "vocab_size": "vocab_size"}
# config.json fields that must be one positive integer.
_COUNTS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "max_position_embeddings", "vocab_size")
# Metadata that changes the model's numerics in ways the families here do not read from GGUF.
_REFUSED = ("rope.scaling.type", "rope.scaling.factor", "attention.sliding_window", "expert_count")


def gguf_module():
    """The `gguf` package, or ConfigError saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise ConfigError("reading a GGUF file needs the gguf package: pip install gguf (or 'tessera[dev]')") from e
    return gguf


def is_gguf_path(path: str | os.PathLike) -> bool:
    """A path that names a GGUF file: one ending in .gguf that is not a directory (existing or not,
    so a missing one is said as such), or a file that starts with GGUF's magic bytes. A directory
    is never one (a model directory may be named anything)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return True
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HuggingFace's row order of a query/key projection (weight [heads*hd, in] or bias [heads*hd])
    from llama.cpp's: within each head llama.cpp interleaves the rows of RoPE's first and second
    halves (row 2i is half 0's row i, row 2i+1 half 1's row i); this puts the halves back apart."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass
class GGUFFile:
    """An opened GGUF file of a supported architecture: its HuggingFace config and its tensors."""

    path: Path
    architecture: str
    hf_config: dict[str, Any]
    reader: Any  # gguf.GGUFReader

    @classmethod
    def open(cls, path: str | os.PathLike) -> GGUFFile:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"GGUF file {str(path)!r} {'is a directory' if path.is_dir() else 'does not exist'}; "
                              "give the path of a .gguf file")
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ConfigError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes 'GGUF')")
        read_metadata(path)  # every count bounded by the file's size before gguf's reader believes it
        gguf = gguf_module()
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:  # noqa: BLE001 - gguf raises ValueError, struct errors, IndexError... on a bad file
            raise ConfigError(f"{str(path)!r} is not a readable GGUF file ({type(e).__name__}: {e}); it may be "
                              "truncated or damaged") from None
        arch = _field(reader, "general.architecture", path)
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{str(path)!r}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}{_from_hf(arch)}")
        found = cls(path, arch, {}, reader)
        found._check_tensor_types()
        found.hf_config = found._config()
        return found

    def _check_tensor_types(self) -> None:
        for t in self.reader.tensors:
            if t.tensor_type.name not in TENSOR_TYPES:
                raise ConfigError(f"{str(self.path)!r}: tensor {t.name!r} has GGUF type {t.tensor_type.name}, "
                                  f"which Tessera does not read; supported: {', '.join(TENSOR_TYPES)}")

    def _config(self) -> dict[str, Any]:
        """config.json's fields, as transformers' GGUF loader makes them for this architecture."""
        arch, fields, spec = self.architecture, self.reader.fields, ARCHITECTURES[self.architecture]
        for key in _REFUSED:
            if f"{arch}.{key}" in fields and key not in spec.reads:
                raise ConfigError(f"{str(self.path)!r}: metadata {arch}.{key} is not supported (Tessera reads "
                                  f"GGUF {arch} models without {key})")
        d: dict[str, Any] = {"model_type": spec.family}
        for key, name in _REQUIRED.items():
            if key not in spec.optional or f"{arch}.{key}" in fields:
                d[name] = _field(self.reader, f"{arch}.{key}", self.path)
        for key, name in _OPTIONAL.items():
            if f"{arch}.{key}" in fields:
                d[name] = _field(self.reader, f"{arch}.{key}", self.path)
        for name in _COUNTS:  # one positive number each (gguf allows arrays: per-layer head counts)
            if name in d and (not isinstance(d[name], int) or isinstance(d[name], bool) or d[name] < 1):
                raise ConfigError(f"{str(self.path)!r}: GGUF metadata for {name} is {d[name]!r}; Tessera reads one "
                                  "positive integer for every layer")
        d.setdefault("rope_theta", 10000.0)  # llama.cpp's and transformers' default
        if spec.permuted:  # transformers takes LLaMA's head_dim from the RoPE dimension
            dims = f"{arch}.rope.dimension_count"
            d["head_dim"] = _field(self.reader, dims, self.path) if dims in fields else \
                d["hidden_size"] // d["num_attention_heads"]
        if "vocab_size" not in d:  # older files: the vocabulary's length
            d["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else \
                _field(self.reader, f"{arch}.vocab_size", self.path)
        if spec.config is not None:
            d.update(spec.config(Metadata(self.path, arch, lambda key: _field(self.reader, key, self.path), fields,
                                          self._small_tensor), d))
        freqs = self._small_tensor("rope_freqs") if spec.rope_freqs else None
        if freqs is not None:
            d["rope_scaling"] = llama3_from_rope_freqs(self.path, freqs, d.get("head_dim") or d["hidden_size"] //
                                                       d["num_attention_heads"], d["rope_theta"])
        d["tie_word_embeddings"] = all(t.name != "output.weight" for t in self.reader.tensors)
        for name in ("bos_token_id", "eos_token_id"):  # a stop rule that can never fire is refused
            if f"tokenizer.ggml.{name}" in fields:
                d[name] = _field(self.reader, f"tokenizer.ggml.{name}", self.path)
                if not isinstance(d[name], int) or isinstance(d[name], bool) or not 0 <= d[name] < d["vocab_size"]:
                    raise ConfigError(f"{str(self.path)!r}: GGUF metadata 'tokenizer.ggml.{name}' is {d[name]!r}, "
                                      f"outside the model's vocabulary of {d['vocab_size']} tokens")
        return d

    def _small_tensor(self, name: str):
        """The float values of 1-D tensor `name` or `name.weight` (a config table such as LongRoPE's), or None."""
        for t in self.reader.tensors:
            if t.name in (name, f"{name}.weight"):
                return gguf_module().quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist()
        return None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HuggingFace name, float32 tensor in HuggingFace's shape and row order), one at a time."""
        for stored in self.stored():
            yield stored.hf_name, stored.dequantized()

    def stored(self) -> Iterator[StoredTensor]:
        """Every tensor of the file as stored (not yet read into memory), under its HuggingFace name."""
        gguf = gguf_module()
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.architecture)
        n_layers = self.hf_config["num_hidden_layers"]
        spec = ARCHITECTURES[self.architecture]
        names = _hf_names(gguf.get_tensor_name_map(arch, n_layers), n_layers, spec.layer_modules)
        permuted = spec.permuted
        heads = {"attn_q": self.hf_config["num_attention_heads"],
                 "attn_k": self.hf_config.get("num_key_value_heads") or self.hf_config["num_attention_heads"]}
        for t in self.reader.tensors:
            base, _, suffix = t.name.rpartition(".")
            if base == "rope_freqs" and not spec.rope_freqs:  # Llama 3's RoPE frequency factors
                raise ConfigError(f"{str(self.path)!r}: tensor 'rope_freqs' holds Llama 3-style RoPE frequency "
                                  f"scaling, which a {self.architecture} model does not have")
            if base in spec.config_tensors or base == "rope_freqs":  # read into the config
                continue
            block, _, kind = base.partition(".")[2].partition(".")
            if spec.extra_blocks and block.isdigit() and int(block) >= n_layers:  # multi-token prediction
                continue
            if spec.placed and kind in spec.placed and base.startswith("blk."):
                yield _placed(self.path, t, int(block), spec.placed[kind], suffix, self.hf_config)
                continue
            if base not in names:
                raise ConfigError(f"{str(self.path)!r}: tensor {t.name!r} has no place in a {self.architecture} "
                                  "model; is the file a language model of that architecture?")
            kind = base.rpartition(".")[2]
            rope_heads = heads[kind] if permuted and kind in heads else 0
            offset = spec.norm_offset if base.endswith("norm") and kind not in spec.unshifted else 0.0
            yield StoredTensor(self.path, t, f"{names[base]}.{suffix}", rope_heads, offset)


def _placed(path: Path, entry, layer: int, placed: Placed, suffix: str, d: dict[str, Any]) -> StoredTensor:
    if suffix not in placed.names:
        raise ConfigError(f"{str(path)!r}: tensor {entry.name!r} has no place in the model; Tessera reads "
                          f"{', '.join(placed.names)} of it")
    return StoredTensor(path, entry, f"model.layers.{layer}.{placed.names[suffix]}", 0,
                        transposed=placed.transposed and suffix == "weight", into=placed.into,
                        convert=_bound(placed.convert, d), select=_bound(placed.select, d),
                        rows=None if placed.rows is None else placed.rows(d))


def _bound(fn, d: dict[str, Any]):
    """`fn(x, d)` as a function of x (None stays None)."""
    return None if fn is None else lambda x: fn(x, d)


@dataclass
class StoredTensor:
    """One tensor of a GGUF file as the file stores it: its GGML type, its HuggingFace shape, and
    its values either dequantized (`dequantized`) or as raw blocks (`raw_blocks`), both in
    HuggingFace's row order."""

    path: Path
    entry: Any  # gguf.ReaderTensor
    hf_name: str
    permute_heads: int  # > 0: llama.cpp's query/key row order, undone over this many heads
    offset: float = 0.0  # what llama.cpp's converter added to the values (Gemma's norms), taken off
    transposed: bool = False  # HuggingFace holds the matrices transposed (gpt-oss's experts)
    into: tuple[int, int] | None = None  # (start, step) of the entries of the HuggingFace tensor's last dim
    convert: Any = None  # values -> the shape of their place (Qwen3-Next's DeltaNet tensors)
    select: Any = None  # the HuggingFace tensor -> the view of it this tensor fills
    rows: Any = None  # the stored rows in HuggingFace's order (an index), or None: as stored

    @property
    def kind(self) -> str:
        return self.entry.tensor_type.name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.entry.shape.tolist()))  # GGUF lists the fastest dim first

    @property
    def nbytes(self) -> int:
        return int(self.entry.n_bytes)

    def dequantized(self) -> torch.Tensor:
        """float32 values, dequantized by gguf's own `quants.dequantize`."""
        gguf = gguf_module()
        try:
            values = torch.from_numpy(gguf.quants.dequantize(self.entry.data, self.entry.tensor_type)
                                      .astype("float32"))  # a copy
        except Exception as e:  # noqa: BLE001 - a block count that does not fit the shape, a short file
            raise ConfigError(f"{str(self.path)!r}: tensor {self.entry.name!r} ({self.kind}) cannot be "
                              f"dequantized ({type(e).__name__}: {e}); the file may be damaged") from None
        values = self._rows_in_hf_order(values - self.offset if self.offset else values)
        if self.convert is not None:
            try:
                values = self.convert(values)
            except (ValueError, RuntimeError) as e:  # rows the metadata's sizes do not split, A not negative
                raise ConfigError(f"{str(self.path)!r}: tensor {self.entry.name!r} of shape {list(values.shape)} "
                                  f"does not fit the model its metadata describes ({e})") from None
        return values.transpose(-1, -2).contiguous() if self.transposed else values

    def raw_blocks(self) -> torch.Tensor:
        """The blocks of a 2-D quantized tensor as uint8 [rows, row bytes] (a copy of the file's bytes)."""
        data = self.entry.data
        rows = self.shape[0]
        if data.dtype.itemsize != 1 or data.size != self.nbytes or self.nbytes % rows:
            raise ConfigError(f"{str(self.path)!r}: tensor {self.entry.name!r} ({self.kind}) holds {data.size} "
                              f"bytes, not the {self.nbytes} its shape {list(self.shape)} needs; the file may be "
                              "damaged")
        return self._rows_in_hf_order(torch.from_numpy(data.reshape(rows, -1).view("uint8").copy()))

    def _rows_in_hf_order(self, values: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            if values.shape[0] != len(self.rows):
                raise ConfigError(f"{str(self.path)!r}: tensor {self.entry.name!r} has {values.shape[0]} rows, but "
                                  f"the model its metadata describes reads {len(self.rows)} from it")
            values = values[self.rows]
        heads = self.permute_heads
        if not heads:
            return values
        if values.shape[0] % (2 * heads):
            raise ConfigError(f"{str(self.path)!r}: tensor {self.entry.name!r} has {values.shape[0]} rows, which "
                              f"{heads} heads cannot split into RoPE halves; the metadata does not fit the weights")
        return permute(values, heads)


def _hf_names(name_map, n_layers: int, per_layer: tuple[str, ...]) -> dict[str, str]:
    """GGUF tensor name (without .weight/.bias) -> HuggingFace module name, for a decoder of
    `n_layers` with modules `per_layer`, from gguf's own table (which maps HuggingFace names to GGUF ones)."""
    modules = ["model.embed_tokens", "model.norm", "lm_head"]
    modules += [f"model.layers.{i}.{m}" for i in range(n_layers) for m in per_layer]
    return {name_map.get_name(m): m for m in modules}


# llama.cpp's names of architectures whose Tessera family is built from HuggingFace directories but
# whose GGUF files are not read yet.
NOT_READ = {"qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "deepseek2": "deepseek_v3"}


def _from_hf(arch: str) -> str:
    if arch not in NOT_READ:
        return ""
    return (f" (Tessera builds the {NOT_READ[arch]} family, but from its HuggingFace directory: convert that "
            "instead of the GGUF file)")


def _field(reader, key: str, path: Path) -> Any:
    """Metadata `key` as a Python value (a string, a number, a list), or ConfigError when absent."""
    if key not in reader.fields:
        raise ConfigError(f"{str(path)!r}: GGUF metadata {key!r} is missing")
    try:
        return reader.fields[key].contents()
    except Exception as e:  # noqa: BLE001 - a damaged field
        raise ConfigError(f"{str(path)!r}: GGUF metadata {key!r} cannot be read ({e})") from None

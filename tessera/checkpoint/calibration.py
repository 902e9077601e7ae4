"""Calibration data for the passes that measure a model before changing it (pruning's importance,
GPTQ's and SmoothQuant's statistics): token sequences cut from text files or the bundled corpus, in
the model directory's own tokenizer; the dtype a directory stores its weights in (what the changed
model is written back as); and the check both make of the source's weights before any work (every
one finite).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

from tessera.checkpoint.hf.slices import HFSliceReader
from tessera.checkpoint.loading import trained_tokenizer
from tessera.config.dtypes import DTYPES, torch_dtype
from tessera.config.errors import ConfigError, DataError
from tessera.data.corpus import select_stdlib_files
from tessera.data.documents import expand_inputs, iter_text_documents
from tessera.data.tokenizer import load_tokenizer


def calibration_texts(calibration: Sequence[str | os.PathLike] | None):
    """The documents of `calibration` (text / JSONL files or directories), or of the bundled corpus."""
    if calibration:
        return (text for text, _ in iter_text_documents(expand_inputs(calibration), jsonl_field="text"))
    return (p.read_text(encoding="utf-8", errors="replace") for p in select_stdlib_files())


def calibration_sequences(texts: Iterable[str], tokenizer, num_sequences: int, seq_len: int) -> torch.Tensor:
    """[num_sequences, seq_len] token ids: the documents tokenized, joined by end-of-text, cut in order.
    Fewer tokens than that is a DataError naming how many there were."""
    need, ids = num_sequences * seq_len, []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
        if len(ids) >= need:
            return torch.tensor(ids[:need], dtype=torch.long).view(num_sequences, seq_len)
    raise DataError(f"the calibration data holds {len(ids)} tokens; {num_sequences} sequences of {seq_len} need "
                    f"{need} (give more text, or fewer / shorter sequences)")


def load_calibration(command: str, src: str | os.PathLike, cfg, calibration: Sequence[str | os.PathLike] | None,
                     num_sequences: int, seq_len: int) -> tuple[torch.Tensor, str | None]:
    """[num_sequences, min(seq_len, context)] calibration token ids for model directory `src` (its
    own tokenizer, else the bundled one), and where its own tokenizer is (None: it has none)."""
    tokenizer_dir = trained_tokenizer(src)
    tokenizer = load_tokenizer(tokenizer_dir)  # the bundled one where the source has none
    if tokenizer.vocab_size > cfg.vocab_size:  # its ids would fall outside the embedding
        whose = "its tokenizer's" if tokenizer_dir is not None else \
            "it has no tokenizer of its own and the bundled one's"
        raise DataError(f"{command}: {str(src)!r}: {whose} vocabulary ({tokenizer.vocab_size}) is larger than the "
                        f"model's ({cfg.vocab_size}); give a directory whose tokenizer fits its model")
    tokens = calibration_sequences(calibration_texts(calibration), tokenizer, num_sequences,
                                   min(seq_len, cfg.max_seq_len))
    return tokens, tokenizer_dir


def stored_dtype(hf: dict) -> torch.dtype:
    """The dtype a HuggingFace config.json says its weights are stored in (fp32 when it names none)."""
    name = hf.get("torch_dtype") or hf.get("dtype")
    return torch_dtype(name) if name in DTYPES else torch.float32


def check_finite_weights(command: str, src: str | os.PathLike, cfg) -> None:
    """Refuse (ConfigError, naming the tensor and its file) a source one of whose weights that the
    model reads holds a NaN or an infinity: quantizing or pruning it would write a model that
    computes NaN (GPTQ's Cholesky factorization fails on it). Read tensor by tensor, before any work."""
    reader = HFSliceReader(src, cfg)
    stored = reader.files.keys()
    for key in sorted({k for keys in reader.names.values() for k in keys if k in stored}):
        finite = torch.isfinite(reader.files.get(key))
        if not bool(finite.all()):
            raise ConfigError(f"{command}: {str(src)!r}: tensor {key!r} (in {reader.files.files[key].name}) is not "
                              f"finite ({int((~finite).sum())} of its {finite.numel()} values are NaN or infinite); "
                              f"refusing to {command} a damaged model")

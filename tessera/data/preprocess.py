"""`tessera preprocess`: text or JSONL files -> a memory-mapped indexed dataset.

Each document is tokenized (with the tokenizer's post-processor, e.g. a leading BOS for LLaMA
tokenizers) and, by default, followed by the end-of-document token, so that samples packed
across document boundaries show the model where one document ends. Documents keep the order of
the inputs, and tokenization is a pure function of the text, so the same inputs and tokenizer
always give byte-identical `.bin` and `.idx` files. Outputs are written under temporary names
and renamed into place when complete.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tessera.config.errors import DataError
from tessera.data.documents import expand_inputs, iter_text_documents
from tessera.data.indexed import IndexedDatasetWriter, token_dtype
from tessera.data.tokenizer import Tokenizer

ENCODE_BATCH_DOCUMENTS = 256  # documents tokenized per call: large enough to use every core
ENCODE_BATCH_CHARS = 1 << 24  # ... but at most ~16M characters held in memory at once


@dataclass(frozen=True)
class PreprocessStats:
    """What a preprocessing run wrote."""

    output_prefix: str
    files: int
    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    loss_tokens: int | None = None  # tokens that count in the loss (SFT answers); None: all of them

    @property
    def bytes_per_token(self) -> float:
        return self.input_bytes / max(self.tokens, 1)


def preprocess(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike, tokenizer: Tokenizer, *,
               jsonl_field: str = "text", text_mode: str = "document", append_eos: bool = True,
               show_progress: bool = True) -> PreprocessStats:
    """Tokenize every document of `inputs` into `output_prefix.bin` / `output_prefix.idx`.

    `inputs` are `.txt` / `.jsonl` files or directories of them (see `tessera.data.documents`);
    `text_mode` is "document" (a `.txt` file is one document) or "line" (each non-empty line is).
    """
    start = time.perf_counter()
    files = expand_inputs(inputs)
    eos_id = tokenizer.eos_id
    if append_eos and eos_id is None:
        raise DataError(f"tokenizer {tokenizer.source or ''} has no eos_token, so documents cannot be ended; "
                        "set eos_token in tokenizer_config.json or pass append_eos=False")
    total_bytes = sum(path.stat().st_size for path in files)
    documents = 0
    with IndexedDatasetWriter(output_prefix, token_dtype(tokenizer.vocab_size)) as writer, \
            tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not show_progress,
                 desc=f"preprocess {Path(output_prefix).name}") as progress:
        batch: list[str] = []
        batch_chars = batch_bytes = 0

        def flush() -> None:
            nonlocal batch_chars, batch_bytes
            for ids in tokenizer.encode_batch(batch):
                writer.add_document(ids + [eos_id] if append_eos else ids)
            progress.update(batch_bytes)
            batch.clear()
            batch_chars = batch_bytes = 0

        for text, size in iter_text_documents(files, jsonl_field=jsonl_field, text_mode=text_mode):
            batch.append(text)
            batch_chars += len(text)
            batch_bytes += size
            documents += 1
            if len(batch) >= ENCODE_BATCH_DOCUMENTS or batch_chars >= ENCODE_BATCH_CHARS:
                flush()
        if batch:
            flush()
        tokens = writer.num_tokens
        if tokens == 0:
            raise DataError(f"the {documents} documents of {', '.join(str(p) for p in files)} hold no tokens "
                            "(empty texts, and no end-of-document token: --no-eos); nothing to train on")
    return PreprocessStats(output_prefix=os.fspath(output_prefix), files=len(files), documents=documents,
                           tokens=tokens, input_bytes=total_bytes, seconds=time.perf_counter() - start)

"""Supervised fine-tuning data: conversations -> token ids plus a loss mask over the answers.

Each JSONL record is either `{"messages": [{"role": ..., "content": ...}, ...]}` or
`{"prompt": ..., "response": ...}` (optionally with `"system"`), the latter read as one user turn
and one assistant turn. A conversation is rendered with the tokenizer's chat template, or with
`PLAIN_CHAT_TEMPLATE` when the tokenizer has none, and tokenized as one string (special tokens
written by the template are recognized, no extra BOS/EOS is added, as in `transformers`).

Answer-only loss: the loss mask is 1 exactly on the tokens of each assistant turn's answer, from
the end of its header to the end of the turn (the turn's end token included, trailing whitespace
not), and 0 on system, user and prompt tokens and on the template's headers. The span of turn `i`
is found from the text alone: rendering `messages[:i]` with the generation prompt gives the text
before the answer, rendering `messages[:i+1]` the text through it. This works for any template
whose rendering of a conversation starts with the rendering of each of its prefixes (all common
ones); a template that rewrites earlier turns is refused with a `DataError`. A token that
straddles an answer boundary counts as an answer token, so every answer character is trained on.

Preprocessing writes the tokens to `prefix.bin/.idx` and the mask, with the same document
offsets, to `prefix.mask.bin/.idx` (uint8); `PackedDataset(prefix, seq_len)` packs both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from tessera.config.errors import DataError
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE
from tessera.data.documents import expand_inputs, iter_jsonl
from tessera.data.indexed import IndexedDatasetWriter, token_dtype
from tessera.data.preprocess import PreprocessStats
from tessera.data.sampling import mask_prefix
from tessera.data.tokenizer import Tokenizer

ANSWER_ROLE = "assistant"


def conversation_from_record(record: dict[str, Any], where: str = "record") -> list[dict[str, str]]:
    """The messages of one SFT record, validated; `where` (e.g. "file.jsonl:3") prefixes errors."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        for number, message in enumerate(messages):
            if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                    or not isinstance(message.get("content"), str)):
                raise DataError(f"{where}: message {number} must be an object with string 'role' and "
                                f"'content', got {message!r:.80}")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    elif "prompt" in record and "response" in record:
        fields = {k: record[k] for k in ("system", "prompt", "response") if k in record}
        for key, value in fields.items():
            if not isinstance(value, str):
                raise DataError(f"{where}: field {key!r} must be a string, found {type(value).__name__}")
        messages = [{"role": "system", "content": fields["system"]}] if "system" in fields else []
        messages += [{"role": "user", "content": fields["prompt"]},
                     {"role": ANSWER_ROLE, "content": fields["response"]}]
    else:
        raise DataError(f"{where}: expected 'messages', or 'prompt' and 'response' "
                        f"(fields present: {', '.join(sorted(record)) or 'none'})")
    if not any(m["role"] == ANSWER_ROLE for m in messages):
        raise DataError(f"{where}: no {ANSWER_ROLE!r} message, so nothing to train on")
    return messages


def render_with_answer_spans(tokenizer: Tokenizer, messages: list[dict[str, str]],
                             chat_template: str | None = None,
                             where: str = "record") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the `[start, end)` character span of each assistant answer."""
    template = chat_template or tokenizer.chat_template or PLAIN_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(messages, chat_template=template)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != ANSWER_ROLE:
            continue
        before = tokenizer.apply_chat_template(messages[:turn], add_generation_prompt=True,
                                               chat_template=template)
        through = tokenizer.apply_chat_template(messages[:turn + 1], chat_template=template)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(f"{where}: the chat template renders turn {turn} differently inside the whole "
                            "conversation than on its own, so the answer cannot be located; "
                            "pass chat_template= with a template that does not rewrite earlier turns")
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def tokenize_conversation(tokenizer: Tokenizer, messages: list[dict[str, str]],
                          chat_template: str | None = None,
                          where: str = "record") -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 loss mask: 1 on the assistant answers."""
    text, spans = render_with_answer_spans(tokenizer, messages, chat_template, where)
    ids, offsets = tokenizer.encode_with_offsets(text, add_special_tokens=False)
    return ids, span_mask(offsets, spans).astype(int).tolist()


def span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per token (its `[start, end)` characters in `offsets`), True where it overlaps one of `spans`:
    a token that straddles a span's boundary counts as inside."""
    starts = np.array([s for s, _ in offsets], dtype=np.int64)
    ends = np.array([e for _, e in offsets], dtype=np.int64)
    mask = np.zeros(len(offsets), dtype=bool)
    for span_start, span_end in spans:
        mask |= (starts < span_end) & (ends > span_start)
    return mask


def preprocess_sft(inputs: Sequence[str | os.PathLike], output_prefix: str | os.PathLike,
                   tokenizer: Tokenizer, *, chat_template: str | None = None,
                   show_progress: bool = True) -> PreprocessStats:
    """Tokenize SFT JSONL `inputs` into `output_prefix` (tokens) and `output_prefix.mask` (loss mask)."""
    start = time.perf_counter()
    files = expand_inputs(inputs, suffixes=(".jsonl",))
    total_bytes = sum(path.stat().st_size for path in files)
    documents = loss_tokens = 0
    # The mask is committed first and the tokens last, so a dataset whose tokens exist has its mask.
    with IndexedDatasetWriter(output_prefix, token_dtype(tokenizer.vocab_size)) as token_writer, \
            IndexedDatasetWriter(mask_prefix(output_prefix), np.uint8) as mask_writer, \
            tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not show_progress,
                 desc=f"preprocess sft {os.path.basename(output_prefix)}") as progress:
        for path in files:
            for number, record, size in iter_jsonl(path):
                where = f"{path}:{number}"
                ids, mask = tokenize_conversation(tokenizer, conversation_from_record(record, where),
                                                  chat_template, where)
                token_writer.add_document(ids)
                mask_writer.add_document(mask)
                documents += 1
                loss_tokens += sum(mask)
                progress.update(size)
        tokens = token_writer.num_tokens
    return PreprocessStats(output_prefix=os.fspath(output_prefix), files=len(files), documents=documents,
                           tokens=tokens, input_bytes=total_bytes, seconds=time.perf_counter() - start,
                           loss_tokens=loss_tokens)

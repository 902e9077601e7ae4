"""Prompts for reinforcement learning on rewards (data.kind=prompts, train.objective=grpo): JSONL
records of a prompt whose other fields reach the reward function.

Each record is `{"prompt": P, ...}` where P is a string, read as one user turn (with `"system"`, a
string, as a system turn before it, as an SFT record's `prompt` is: tessera.data.sft), or a
non-empty list of `{"role", "content"}` messages (a conversation so far). Every other field (a
reference `answer`, unit-test code `test`, ...) is kept as it is and passed to the reward as a
keyword argument (tessera.eval.rewards). The prompt is rendered by the tokenizer's chat template (or
`PLAIN_CHAT_TEMPLATE`) with the generation prompt, and tokenized as one string; a completion follows it.

A record is one sample (`PromptSample`): `tokens` int64 [seq_len + 1], the prompt's ids padded with
token 0, `loss_mask` True on the prompt's tokens (the prompt's length is its sum), and `record`, the
record itself, which `collate` hands on as `Batch.records`. A prompt that leaves no room for
`max_new_tokens` completion tokens in the context (seq_len + 1 tokens, fewer where the model has
fewer positions) is refused with a DataError
naming the file and line, and so is a record without a prompt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tessera.config.errors import DataError
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE
from tessera.data.documents import expand_inputs, iter_jsonl
from tessera.data.preference import prompt_messages
from tessera.data.tokenizer import Tokenizer


class PromptSample(NamedTuple):
    """A `Sample` (tessera.data.sampling) of one prompt (module docstring)."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    record: dict[str, Any]


def prompt_ids(tokenizer: Tokenizer, record: dict[str, Any], where: str) -> list[int]:
    """The token ids of a record's prompt, rendered with the generation prompt (module docstring)."""
    if "prompt" not in record:
        raise DataError(f"{where}: a prompt record needs 'prompt' (fields present: "
                        f"{', '.join(sorted(record)) or 'none'})")
    messages = prompt_messages(record, where)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         chat_template=tokenizer.chat_template or PLAIN_CHAT_TEMPLATE)
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_sample(tokenizer: Tokenizer, record: dict[str, Any], seq_len: int, max_new_tokens: int,
                  where: str, context: int | None = None) -> PromptSample:
    """One record as a sample of seq_len + 1 tokens, refused when its completion would not fit the
    `context` (default seq_len + 1 tokens; the model's positions may make it shorter)."""
    ids = prompt_ids(tokenizer, record, where)
    context = seq_len + 1 if context is None else context
    room = context - max_new_tokens
    if len(ids) > room:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens, longer than the {max(room, 0)} the context leaves "
                        f"({context} tokens: train.seq_len + 1, at most model.max_seq_len; less "
                        f"train.grpo.max_new_tokens={max_new_tokens}); raise train.seq_len, lower max_new_tokens or "
                        "shorten the prompt")
    tokens, mask = np.zeros(seq_len + 1, dtype=np.int64), np.zeros(seq_len + 1, dtype=bool)
    tokens[:len(ids)], mask[:len(ids)] = ids, True
    return PromptSample(tokens, mask, record)


class PromptDataset:
    """The prompts of one JSONL file in memory (a `SampleDataset` of `PromptSample`s)."""

    def __init__(self, samples: list[PromptSample], seq_len: int, source: str = ""):
        if not samples:
            raise DataError(f"{source or 'a prompt dataset'}: no prompt records")
        self.samples, self.seq_len, self.source = samples, seq_len, source

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]

    def __repr__(self) -> str:
        return f"PromptDataset({self.source!r}, {len(self.samples)} prompts)"


def load_prompt_file(path: str | os.PathLike, tokenizer: Tokenizer, seq_len: int, max_new_tokens: int,
                     vocab_size: int | None = None, context: int | None = None) -> PromptDataset:
    """Every record of one JSONL file as a prompt (module docstring); with `vocab_size`, a token id
    outside the model's vocabulary is refused."""
    [file] = expand_inputs([path], suffixes=(".jsonl",))
    samples = []
    for number, record, _ in iter_jsonl(file):
        where = f"{file}:{number}"
        sample = prompt_sample(tokenizer, record, seq_len, max_new_tokens, where, context)
        if vocab_size is not None and int(sample.tokens.max()) >= vocab_size:
            raise DataError(f"{where}: token id {int(sample.tokens.max())} is outside model.vocab_size={vocab_size}: "
                            "the tokenizer does not fit the model")
        samples.append(sample)
    return PromptDataset(samples, seq_len, str(file))


def load_prompt_files(paths: Sequence[str | os.PathLike], tokenizer: Tokenizer, seq_len: int, max_new_tokens: int,
                      vocab_size: int | None = None, context: int | None = None) -> list[PromptDataset]:
    """`load_prompt_file` of each path, in order."""
    return [load_prompt_file(p, tokenizer, seq_len, max_new_tokens, vocab_size, context) for p in paths]

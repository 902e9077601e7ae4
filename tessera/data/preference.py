"""Preference pairs for Direct Preference Optimization (data.kind=preference, train.objective=dpo):
JSONL records of a prompt and two answers to it, the chosen one and the rejected one.

Each record is `{"prompt": P, "chosen": A, "rejected": A}` (other fields are ignored), where

- P is a string, read as one user turn (with `"system"`, a string, as a system turn before it, as
  an SFT record's `prompt` is: tessera.data.sft), or a non-empty list of `{"role", "content"}`
  messages (a conversation so far);
- A is a string, read as one assistant turn, or a non-empty list of messages holding at least one
  assistant turn.

Each answer follows its prompt in one conversation rendered with the tokenizer's chat template (or
`PLAIN_CHAT_TEMPLATE`) and tokenized as one string, as an SFT conversation is, and its loss mask is
1 exactly on the answer's assistant turns (tessera.data.sft's answer spans: the turn's end token
included, trailing whitespace not; the prompt's own assistant turns are not scored). DPO scores an
answer by the sum of its tokens' log-probabilities under that mask. A pair is one sample: `tokens`
and `loss_mask` of shape [2, seq_len + 1], the chosen sequence then the rejected one, each padded
with token 0 outside the mask. An answer with nothing to score, and a prompt and answer longer
than the context (seq_len + 1 tokens), are refused with a DataError naming the file and line: an
answer is never cut.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from tessera.config.errors import DataError
from tessera.data.documents import expand_inputs, iter_jsonl
from tessera.data.sft import ANSWER_ROLE, render_with_answer_spans, span_mask
from tessera.data.tokenizer import Tokenizer

ANSWERS = ("chosen", "rejected")


class PreferenceSample(NamedTuple):
    """A `Sample` (tessera.data.sampling) of one pair: int64 `tokens` and bool `loss_mask`, both
    [2, seq_len + 1]: row 0 the prompt and chosen answer, row 1 the prompt and rejected answer."""

    tokens: np.ndarray
    loss_mask: np.ndarray


def _messages(value: Any, key: str, where: str) -> list[dict[str, str]]:
    """A record field that holds a list of `{"role", "content"}` messages, validated."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {key!r} must be a string or a non-empty list of {{role, content}} messages, "
                        f"got {value!r:.80}")
    for number, message in enumerate(value):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise DataError(f"{where}: {key!r} message {number} must be an object with string 'role' and "
                            f"'content', got {message!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def prompt_messages(record: dict[str, Any], where: str) -> list[dict[str, str]]:
    """A record's `prompt` as messages: a string as one user turn (after its `system` turn), or a list
    of messages, validated (also tessera.data.prompts')."""
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        return _messages(prompt, "prompt", where)
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: field 'system' must be a string, found {type(system).__name__}")
    messages = [{"role": "system", "content": system}] if system is not None else []
    return messages + [{"role": "user", "content": prompt}]


def pair_conversations(record: dict[str, Any], where: str) -> tuple[list[dict[str, str]], list[list[dict[str, str]]]]:
    """The prompt's messages and each answer's (chosen, rejected) of one record, validated."""
    missing = [key for key in ("prompt", *ANSWERS) if key not in record]
    if missing:
        present = ", ".join(sorted(record)) or "none"
        raise DataError(f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; missing "
                        f"{', '.join(repr(k) for k in missing)} (fields present: {present})")
    messages = prompt_messages(record, where)
    answers = []
    for key in ANSWERS:
        value = record[key]
        turns = [{"role": ANSWER_ROLE, "content": value}] if isinstance(value, str) else _messages(value, key, where)
        said = [m["content"] for m in turns if m["role"] == ANSWER_ROLE]
        if not said:
            raise DataError(f"{where}: {key!r} holds no {ANSWER_ROLE!r} message, so it has nothing to score")
        if not any(text.strip() for text in said):
            raise DataError(f"{where}: {key!r} is empty: an answer needs at least one character to score")
        answers.append(turns)
    return messages, answers


def tokenize_answer(tokenizer: Tokenizer, prompt: list[dict[str, str]], answer: list[dict[str, str]],
                    where: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the prompt and answer rendered as one conversation, and the answer's mask."""
    messages = prompt + answer
    text, spans = render_with_answer_spans(tokenizer, messages, where=where)
    spans = spans[sum(m["role"] == ANSWER_ROLE for m in prompt):]  # the answer's assistant turns only
    ids, offsets = tokenizer.encode_with_offsets(text, add_special_tokens=False)
    return np.asarray(ids, dtype=np.int64), span_mask(offsets, spans)


def _fit(ids: np.ndarray, mask: np.ndarray, key: str, length: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One answer's row padded to `length` tokens, refused when it holds no answer token or does not fit."""
    if not mask[1:].any():  # the first token is never predicted
        raise DataError(f"{where}: {key!r} has no token to score once rendered (its answer is empty)")
    prompt_tokens = int(np.argmax(mask))
    if prompt_tokens >= length:
        raise DataError(f"{where}: the prompt is {prompt_tokens} tokens, longer than the context of "
                        f"train.seq_len + 1 = {length} tokens, which leaves no room for an answer; raise "
                        "train.seq_len (up to model.max_seq_len) or shorten the prompt")
    if len(ids) > length:
        raise DataError(f"{where}: the prompt and {key!r} are {len(ids)} tokens, longer than the context of "
                        f"train.seq_len + 1 = {length} tokens; raise train.seq_len (up to model.max_seq_len) or "
                        "shorten the pair (an answer is never cut)")
    row, row_mask = np.zeros(length, dtype=np.int64), np.zeros(length, dtype=bool)
    row[:len(ids)], row_mask[:len(ids)] = ids, mask
    return row, row_mask


def preference_sample(tokenizer: Tokenizer, record: dict[str, Any], seq_len: int, where: str) -> PreferenceSample:
    """One record as a pair of rows of seq_len + 1 tokens (module docstring)."""
    prompt, answers = pair_conversations(record, where)
    rows = [_fit(*tokenize_answer(tokenizer, prompt, answer, where), key, seq_len + 1, where)
            for key, answer in zip(ANSWERS, answers)]
    return PreferenceSample(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))


class PreferenceDataset:
    """The pairs of one JSONL file in memory (a `SampleDataset` of `PreferenceSample`s)."""

    def __init__(self, samples: list[PreferenceSample], seq_len: int, source: str = ""):
        if not samples:
            raise DataError(f"{source or 'a preference dataset'}: no preference records")
        self.samples, self.seq_len, self.source = samples, seq_len, source

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PreferenceSample:
        return self.samples[index]

    def __repr__(self) -> str:
        return f"PreferenceDataset({self.source!r}, {len(self.samples)} pairs)"

    @property
    def answer_tokens(self) -> int:
        """Answer tokens over every pair, both answers (what DPO scores)."""
        return int(sum(s.loss_mask[:, 1:].sum() for s in self.samples))


def load_preference_file(path: str | os.PathLike, tokenizer: Tokenizer, seq_len: int,
                         vocab_size: int | None = None) -> PreferenceDataset:
    """Every record of one JSONL file as a pair (module docstring); with `vocab_size`, a token id
    outside the model's vocabulary is refused."""
    [file] = expand_inputs([path], suffixes=(".jsonl",))
    samples = []
    for number, record, _ in iter_jsonl(file):
        where = f"{file}:{number}"
        sample = preference_sample(tokenizer, record, seq_len, where)
        if vocab_size is not None and int(sample.tokens.max()) >= vocab_size:
            raise DataError(f"{where}: token id {int(sample.tokens.max())} is outside model.vocab_size={vocab_size}: "
                            "the tokenizer does not fit the model")
        samples.append(sample)
    return PreferenceDataset(samples, seq_len, str(file))


def load_preference_files(paths: Sequence[str | os.PathLike], tokenizer: Tokenizer, seq_len: int,
                          vocab_size: int | None = None) -> list[PreferenceDataset]:
    """`load_preference_file` of each path, in order."""
    return [load_preference_file(p, tokenizer, seq_len, vocab_size) for p in paths]

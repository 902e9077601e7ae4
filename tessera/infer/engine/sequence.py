"""A request inside the engine: its tokens, how many of them have keys/values in the cache, its
block table, and what it has produced so far.

Invariant while decoding: `len(token_ids) == num_computed + 1`; the newest token is the input of
the next step. A prompt being prefilled has `num_computed < len(token_ids)`, possibly in chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from tessera.infer.runner.multimodal import PromptImage, cache_ids
from tessera.infer.sampling.logprobs import TokenLogprobs
from tessera.infer.sampling.params import SamplingParams
from tessera.infer.sampling.structured_output import GrammarMatcher


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request (streamed to the client as it comes)."""

    request_id: str
    new_token_ids: list[int]
    delta: str  # text to append to what was sent before
    text: str  # the whole completion text so far
    token_ids: list[int]  # the whole completion so far
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    prompt_tokens: int
    error: str | None = None
    client_error: bool = False  # the error lies in the request itself (its schema), not in the server
    logprobs: list[TokenLogprobs] | None = None  # of each token of `token_ids`, when the request asks them
    prompt_logprobs: list[TokenLogprobs] | None = None  # of each prompt token after the first, when asked
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop"), None for any other end
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (on the last output)


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    adapter: str | None = None  # dynamic LoRA adapter name, None for the base model
    adapter_key: bytes = b""  # identity of the adapter's weights, part of the prefix-cache hash
    adapter_slot: int = -1  # the adapter's dynamic LoRA slot (fixed while a request uses it), -1 for none
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # prompt + completion
    num_computed: int = 0  # leading tokens whose keys/values are in the cache
    prompt_cached: int | None = None  # prompt tokens the prefix cache held when first admitted (None: not yet)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the registered full blocks
    # the windowed layers' blocks, entry i for positions of block i; given-back ones are the pool's scratch
    # block (tessera/infer/scheduling/window_blocks.py); empty when the model has no windowed pool
    window_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    pin_prefix: bool = False  # a system prompt: its full blocks stay cached for good
    stop_ids: frozenset[int] = frozenset()
    grammar: GrammarMatcher | None = None  # structured output: what the next token may be
    seed: int = 0  # the counter-based sampling seed (device_sampling); the draws of output n use (seed, n)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of each output token (params.logprobs set)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt tokens 1.. (params.prompt_logprobs)
    images: tuple[PromptImage, ...] = ()  # the prompt's images, by the placeholders they fill (multimodal.py)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def cache_token_ids(self) -> list[int]:
        """What the prefix cache hashes: `token_ids`, each image's placeholders standing as its content key."""
        if not self.images:
            return self.token_ids
        return cache_ids(self.prompt_ids, self.images) + self.token_ids[len(self.prompt_ids):]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities are asked and not all recorded yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt - 1

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1 and len(self.token_ids) > self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

"""A request the engine has checked (`LLMEngine.check_request`) and can queue without a second look.

The HTTP server checks each request in a worker thread, its errors answered as a 4xx naming the
request field (`RequestError.field`), then hands the checked request to the engine thread, which only
queues it; `LLMEngine.add_request` checks what a caller gives it unchecked, the same way, once.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.infer.sampling.params import SamplingParams
from tessera.infer.sampling.structured_output import GrammarMatcher


@dataclass(frozen=True)
class CheckedRequest:
    """A prompt with its image marks widened to placeholders, its images' pixel values, its sampling
    parameters and adapter, and the grammar matcher its `response_format` compiled to (its own: the
    matcher keeps the request's parse state; None for free text)."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    images: tuple
    grammar: GrammarMatcher | None

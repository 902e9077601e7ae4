"""What a request asks of decoding: how to pick tokens and when to stop."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from tessera.config.errors import RequestError
from tessera.infer.api.quoting import brief
from tessera.infer.sampling.response_format import schema_of

# Below this a temperature is a request for greedy decoding that would instead divide the logits
# by (nearly) zero: in fp32 1e-300 is 0 and logits / 0 are inf/NaN. 0 means greedy.
MIN_TEMPERATURE = 1e-5
# The most top log-probabilities a request may ask for per position (vLLM's default cap).
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature 0 is greedy (argmax); a positive one is at least MIN_TEMPERATURE. Otherwise logits
    are divided by `temperature`, cut to the `top_k` most likely tokens (0 = all) and to the
    smallest set whose probability reaches `top_p` (nucleus sampling, Holtzman et al. 2020), then
    sampled with a generator seeded by `seed`, so a request with a seed gives the same text
    whatever else is in the batch.
    Generation stops at `max_tokens`, at an end-of-sequence token (unless `ignore_eos`), at any of
    `stop_token_ids`, or when the text contains one of `stop` (the stop string is cut off).
    `response_format` constrains the output to JSON as in the OpenAI API: `{"type": "json_object"}`
    or `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` (see
    `structured_output`); the request then also stops when the document is complete.
    `guided_grammar` does the same for a grammar in llguidance's Lark syntax, which the server builds
    for constrained tool calls (`tessera/infer/agents/tool_grammar.py`); not an API field, and never
    together with `response_format`.

    Before temperature and the cuts, the logits are changed as vLLM does (in this order):
    `logit_bias` (token id -> value in [-100, 100]) is added; `repetition_penalty` (HuggingFace's
    definition, > 0, 1 = off) divides the positive logits and multiplies the negative ones of every
    token seen in the prompt or the output; `frequency_penalty` times a token's count in the output
    and `presence_penalty` where that count is positive are subtracted (OpenAI's definitions, each in
    [-2, 2]). Greedy requests take the argmax of the changed logits.
    `logprobs` (0..MAX_LOGPROBS, None = off) asks for each output token's log-probability and the
    `logprobs` most likely tokens at its position; `prompt_logprobs` the same for every prompt token
    after the first. Both are of the model's raw distribution: log_softmax of the logits before
    any of the changes above, temperature or the cuts (vLLM's default, "raw_logprobs").
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    response_format: dict | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    guided_grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = _converted("stop_token_ids", self.stop_token_ids,
                                         lambda ids: [_token_id(t) for t in ids])
        self.logit_bias = _converted("logit_bias", self.logit_bias,
                                     lambda bias: {_token_id(k): float(v) for k, v in dict(bias).items()})
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
             "must be an integer >= 1"),
            (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0, "temperature",
             self.temperature, f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 100]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
             "must be an integer >= 0 (0 = no limit)"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]"),
            (self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "seed", self.seed,
             "must be None or an integer in [0, 2^63)"),
            (all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "stop", self.stop,
             "must be at most 16 non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
             "must be token ids >= 0"),
            *[(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), key, value,
               f"must be None or an integer in [0, {MAX_LOGPROBS}]")
              for key, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs))],
            *[(-2.0 <= value <= 2.0, key, value, "must be in [-2, 2]")
              for key, value in (("presence_penalty", self.presence_penalty),
                                 ("frequency_penalty", self.frequency_penalty))],
            (0.0 < self.repetition_penalty <= 1e4, "repetition_penalty", self.repetition_penalty,
             "must be > 0 (1 = off) and at most 1e4"),
            (all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()), "logit_bias",
             self.logit_bias, "must map token ids >= 0 to values in [-100, 100]"),
            (self.guided_grammar is None or self.response_format is None, "response_format", self.response_format,
             "must be unset when the output is already constrained (to tool calls: tool_choice)"),
        ]
        for ok, key, value, allowed in checks:
            if not ok:
                raise RequestError(f"{key}={brief(value)} is invalid: {allowed}", field=key)
        schema_of(self.response_format)  # its shape; the schema itself compiles when the request is admitted

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0

    @property
    def decodes_singly(self) -> bool:
        """Whether every step must sample exactly one token from the row's own logits (no speculative
        drafts): the logits are changed by the tokens so far, or their log-probabilities are asked."""
        return self.changes_logits or self.logprobs is not None


def _token_id(value: object) -> int:
    """A token id given as an integer (Python's, NumPy's, a 0-d tensor's: anything with __index__)
    or as a string of the digits 0-9 (a JSON object's key), not as a boolean. str.isdigit() would also
    take superscripts and other digits ("²") that int() refuses."""
    if isinstance(value, bool):
        raise TypeError("a token id is an integer, not a boolean")
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()):
            raise ValueError(f"a token id is written in the digits 0-9, got {value!r}")
        return int(value)
    return operator.index(value)


def _converted(key: str, value, convert):
    """`convert(value)`; RequestError naming `key` when it cannot be converted (a TypeError or ValueError)."""
    try:
        return convert(value)
    except (TypeError, ValueError, OverflowError):
        raise RequestError(f"{key}={brief(value)} is invalid: token ids must be integers >= 0"
                           + (" mapped to numbers in [-100, 100]" if key == "logit_bias" else ""), field=key) from None

"""Structured output: decoding constrained to a JSON schema, as the OpenAI API's `response_format`,
or to a grammar in llguidance's Lark syntax (`SamplingParams.guided_grammar`: constrained tool calls).

The JSON schema a request's `response_format` asks for (`response_format.schema_of`) is compiled
into a grammar by llguidance (a Rust library with an Earley parser over the tokenizer's token trie)
when the request is admitted, so that an invalid schema is refused before anything is queued. Each
step, every sequence with a grammar gets a bitmask of the tokens that keep its output a prefix of
some valid document (computed on the CPU, one bit per token); the masks of the batch go to the
device together and set the forbidden logits to -inf before sampling, so greedy, temperature,
top-k/top-p and seeded sampling all draw from the allowed tokens only. Sequences without a grammar
are not touched. The sampled token advances the matcher; the sequence ends when the document is
complete (or at an end-of-sequence token, which the mask allows only where the document may end).

The schema is always enforced (`strict` is accepted and has no further effect). Output is JSON
in the compact form `{"a": 1, "b": [2, 3]}`: one space after ':' and ',' and no other whitespace,
so that a model cannot spend its tokens on layout; a schema may set llguidance's own options in
`"x-guidance"` (e.g. `{"whitespace_flexible": true}`).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import Any

import torch

from tessera.infer.sampling.response_format import GrammarError, invalid_format, schema_of

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHED_GRAMMARS = 64  # compiled matchers kept for reuse: a service sees the same few schemas again and again


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise GrammarError("response_format needs the llguidance package: pip install 'tessera[structured]'") from e
    return llguidance


class _TokenBytes:
    """A tokenizer as llguidance's `TokenizerWrapper` reads it: every token's bytes, for tokenizers
    whose `tokenizer.json` llguidance cannot read itself (word-level or character vocabularies,
    whose tokens decode independently of their neighbours)."""

    def __init__(self, backend, vocab_size: int, eos_id: int | None):
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.eos_token_id, self.bos_token_id = eos_id, None
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for i in range(vocab_size):
            token = backend.id_to_token(i)
            if token is None:
                self.tokens.append(b"")
            elif token in special:
                self.special_token_ids.append(i)
                self.tokens.append(token.encode())
            else:
                self.tokens.append(backend.decode([i], skip_special_tokens=False).encode())
        self._backend = backend

    def __call__(self, text: str | bytes) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._backend.encode(text, add_special_tokens=False).ids


class GrammarMatcher:
    """One request's grammar state: the tokens allowed next, and whether the document is complete."""

    def __init__(self, matcher, mask_words: int):
        self.matcher = matcher
        self.mask_words = mask_words  # 32-bit words of its token bitmask (the grammar engine's vocabulary)

    def advance(self, tokens: list[int]) -> None:
        """Feed the sampled tokens; GrammarError if the grammar refuses one. The mask allows only
        tokens the grammar accepts, so a refusal means llguidance failed on this schema mid-way
        (e.g. an `anyOf` of thousands of branches exceeds its parser's row limit)."""
        if not self.matcher.consume_tokens(tokens):
            why = self.matcher.get_error().replace("<non-verbose/>", "").strip()[:300]
            raise GrammarError(f"structured output failed: the grammar engine refused the sampled token: {why} "
                               "(the schema may exceed the grammar engine's limits; simplify it)")

    @property
    def finished(self) -> bool:
        """True when the document is complete and nothing but end-of-sequence may follow."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Turns `response_format`s into per-request matchers for one tokenizer and vocabulary.

    The llguidance tokenizer (a token trie of the vocabulary) is built on first use; compiled
    grammars are kept (least recently used out) and copied per request. Thread-safe: requests
    are checked in the server's worker threads and admitted in the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltokenizer = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        llg = _llguidance()
        with self._lock:
            if self._lltokenizer is None:
                if self.tokenizer is None:
                    raise GrammarError("response_format needs a tokenizer; this model directory has none")
                backend = self.tokenizer.backend
                n = max(self.vocab_size, self.tokenizer.vocab_size)
                eos = self.eos_ids or None
                try:
                    self._lltokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=n, eos_token=eos)
                except ValueError:  # a decoder llguidance does not know: give it every token's bytes
                    wrapper = _TokenBytes(backend, n, self.eos_ids[0] if self.eos_ids else None)
                    self._lltokenizer = llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=n, eos_token=eos)
            return self._lltokenizer

    def matcher(self, response_format: dict | None) -> GrammarMatcher | None:
        """A fresh matcher for the request (None for free text); GrammarError naming the problem
        when the schema does not compile. Compiling holds no lock (llguidance releases the GIL
        meanwhile), so a large schema being checked in a worker thread never stalls the engine."""
        schema = schema_of(response_format)
        if schema is None:
            return None

        def refused(why: str) -> GrammarError:
            return invalid_format(response_format, f"the schema cannot be compiled: {why}")

        def grammar(llg):
            try:
                return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise invalid_format(response_format, f"json_schema.schema: {str(e)[:300]}") from e

        return self._matcher(json.dumps(schema, sort_keys=True), grammar, refused)

    def lark_matcher(self, guided_grammar: str) -> GrammarMatcher:
        """A fresh matcher of a grammar in llguidance's Lark syntax (`SamplingParams.guided_grammar`,
        which the server builds: a tool-call grammar); GrammarError naming `tools` when it does not
        compile."""
        return self._matcher("lark:" + guided_grammar, lambda llg: llg.LLMatcher.grammar_from_lark(guided_grammar),
                             lambda why: GrammarError(f"the tools' grammar cannot be compiled: {why}", "tools"))

    def _matcher(self, key: str, grammar, refused) -> GrammarMatcher:
        """A copy of the compiled matcher cached under `key`, compiling `grammar(llguidance)` first
        when there is none; `refused(why)` is the error of a grammar that does not compile."""
        llg = _llguidance()
        tokenizer = self._ll_tokenizer()
        with self._lock:
            prototype = self._cache.get(key)
            if prototype is not None:
                self._cache.move_to_end(key)
                return GrammarMatcher(prototype.deep_copy(), (tokenizer.vocab_size + 31) // 32)
        prototype = llg.LLMatcher(tokenizer, grammar(llg), log_level=0,
                                  limits=llg.LLParserLimits(verbose_errors=False))
        if prototype.is_error():
            raise refused(prototype.get_error()[:300])
        with self._lock:
            self._cache[key] = prototype
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return GrammarMatcher(prototype.deep_copy(), (tokenizer.vocab_size + 31) // 32)


@functools.cache
def _mask_executor():
    """llguidance's thread pool that computes the bitmasks of a batch (one per process)."""
    return _llguidance().LLExecutor()


def mask_logits(logits_TV: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> None:
    """Set to -inf, in place on the logits' device, every token that `matchers[i]` forbids at row
    `rows[i]`. One bitmask tensor for the batch is filled on the CPU, copied once and unpacked on
    the device. (A row left with no token allowed samples a token that `advance` refuses, or no
    token at all: either way that request alone fails.)"""
    if not rows:
        return
    V = logits_TV.shape[-1]
    words = matchers[0].mask_words  # the matchers of one engine share its tokenizer
    mask_NW = torch.zeros((len(rows), words), dtype=torch.int32, pin_memory=logits_TV.is_cuda)
    _mask_executor().unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(matchers)],
                                             mask_NW.data_ptr(), words * 4, len(rows))
    allowed_NV = unpack_bitmask(mask_NW.to(logits_TV.device, non_blocking=True), V)
    index = torch.tensor(rows, device=logits_TV.device)
    with torch.inference_mode():
        masked = logits_TV.index_select(0, index).masked_fill_(~allowed_NV, float("-inf"))
        logits_TV.index_copy_(0, index, masked)


def unpack_bitmask(mask_NW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 words, bit j of word w for token 32 w + j -> [N, vocab_size] booleans."""
    bits = torch.arange(32, dtype=torch.int32, device=mask_NW.device)
    unpacked_NW32 = (mask_NW.unsqueeze(-1) >> bits) & 1
    return unpacked_NW32.reshape(mask_NW.shape[0], -1)[:, :vocab_size].bool()

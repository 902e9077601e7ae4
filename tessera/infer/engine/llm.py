"""Offline generation in Python: a list of prompts in, a list of completions out.

    from tessera.infer import LLM, SamplingParams

    llm = LLM("path/to/hf-model")
    for c in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0)):
        print(c.text)

All prompts go into one engine and are batched continuously; the results come back in the order
of the prompts. `LLM` also takes a model already in memory (`LLM(transformer, tokenizer=...)`):
that is how `tessera generate` runs a checkpoint through the same engine as the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.config.errors import ConfigError, ServingError
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.sampling.params import SamplingParams
from tessera.models.transformer import Transformer
from tessera.models.vision.vision_language import VisionLanguageModel


@dataclass
class Completion:
    prompt: str | None  # the prompt text (None when given as token ids)
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"


class LLM:
    """`LLM(model_dir, **engine_options)`: any `EngineConfig` field may be passed by keyword
    (e.g. `quantization="int8"`, `speculative=SpeculativeConfig(...)`), or a whole `config=`.

    `model` is a directory (HuggingFace, pre-quantized or Tessera checkpoint; it brings its own
    tokenizer and end-of-sequence ids) or a `Transformer` in memory, whose `tokenizer` (None: token-id
    prompts only) and `eos_ids` are then given here.

    `tensor_parallel_size=N` splits the model over N ranks: this process and N - 1 workers it
    starts (`close()`, or a `with` block, stops them; so does dropping the `LLM`, or the end of
    the interpreter). The workers are started with the "spawn" method, which imports the calling
    script's main module again, so a script that creates such an `LLM` needs the
    `if __name__ == "__main__":` guard around its top-level code. A `Transformer` given with N > 1
    is cut in place into rank 0's shard and belongs to the `LLM` from then on. If a rank fails,
    or a step is interrupted (Ctrl-C), the ranks are out of step and every later call raises
    `WorkerFailure`: make a new `LLM`.
    """

    def __init__(self, model: str | Path | Transformer | VisionLanguageModel, config: EngineConfig | None = None, *,
                 tokenizer=None, eos_ids: Iterable[int] = (), **options: Any):
        if config is not None and options:
            raise ConfigError("pass either config= or keyword options, not both")
        self.config = config or EngineConfig(**options)
        if isinstance(model, Transformer | VisionLanguageModel):
            self.engine = LLMEngine.from_model(model, self.config, tokenizer, frozenset(eos_ids))
        elif tokenizer is not None or eos_ids:
            raise ConfigError("tokenizer= and eos_ids= go with a model in memory; a directory brings its own")
        else:
            self.engine = LLMEngine.from_dir(model, self.config)
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this model directory has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | Sequence[str | None] | None = None,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Completion]:
        """Complete every prompt (text, or a list of token ids); `params` and `adapter` may be one
        value for all prompts or one per prompt. `images` (a vision-language model): one list per
        prompt of PIL images or encoded image bytes, each in the place of one image token id of
        the prompt (`"<image>"` in LLaVA's vocabularies), in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        adapters = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * n
        image_lists = [list(i) for i in images] if images is not None else [[] for _ in range(n)]
        if len(params_list) != n or len(adapters) != n or len(image_lists) != n:
            raise ConfigError(f"got {n} prompts but {len(params_list)} params, {len(adapters)} adapters and "
                              f"{len(image_lists)} image lists")
        encoded = [self.encode(p) for p in prompts]
        pixels = [[self.engine.pixel_values(im) for im in imgs] for imgs in image_lists]
        checked = [self.engine.check_request(e, p, a, px)  # all refused before anything is queued
                   for e, p, a, px in zip(encoded, params_list, adapters, pixels)]
        ids = [self.engine.add_request(request) for request in checked]
        done: dict[str, Any] = {}
        while len(done) < n:
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        results = []
        for rid, prompt, enc in zip(ids, prompts, encoded):
            out = done[rid]
            if out.finish_reason == "error":  # the request's own fault (its schema), or the model's
                raise (ConfigError if out.client_error else ServingError)(f"request failed: {out.error}")
            results.append(Completion(prompt if isinstance(prompt, str) else None, enc, out.text, out.token_ids,
                                      out.finish_reason))
        return results

    def close(self) -> None:
        """Stop the worker processes of tensor-parallel serving (nothing to do with one rank)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load_lora(self, name: str, path: str | Path) -> None:
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

"""Tessera as an lm-evaluation-harness model: `TesseraLM`, registered with lm-eval as "tessera".

    from tessera.eval.lm_eval_model import TesseraLM
    lm = TesseraLM(llm=LLM("runs/tiny-dense"))           # or TesseraLM(pretrained="DIR", tensor_parallel_size=2)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

Everything runs in this process on the serving engine (`tessera.infer.LLM`):

- `loglikelihood` (multiple-choice tasks) and `loglikelihood_rolling` (perplexity tasks) score token
  sequences through the executor (`tessera.eval.scoring`), batched over the paged KV cache;
- `generate_until` submits every request to the engine at once (continuous batching), greedy or
  sampled as the task's generation kwargs say, and stops at the task's `until` strings and the
  end-of-sequence token.

Tokenization, context truncation, the rolling windows, the stop strings and the post-processing of
generated text follow lm-eval's HuggingFace backend (`hf`), so that for the same model exported to
HuggingFace the two give the same numbers (tests/eval/test_lm_eval_parity.py): contexts are encoded
with the tokenizer's post-processor (a BOS where the tokenizer adds one) unless they already start
with the prefix token, an empty context is the prefix token (BOS, else EOS), a request longer than
`max_length + 1` tokens loses tokens on the left, and rolling windows are lm-eval's own
(`get_rolling_token_windows` with a context of one token).
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tessera.config.errors import ConfigError
from tessera.eval.scoring import ScoreRequest, score_requests
from tessera.infer.engine.llm import LLM
from tessera.infer.sampling.params import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for tasks that do not say


@register_model("tessera")
class TesseraLM(TemplateLM):
    """`llm`: an `LLM` already built (in-process use), or `pretrained`: a directory Tessera serves (a run,
    a checkpoint, a HuggingFace or pre-quantized directory) with `EngineConfig` fields as keywords
    (`tensor_parallel_size`, `dtype`, `kv_cache_gib`, ...; lm-eval's `--model_args`). `max_length`
    (None: the engine's max_model_len) bounds context + continuation as in the `hf` backend."""

    def __init__(self, pretrained: str | None = None, llm: LLM | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, batch_size: Any = None, max_batch_size: Any = None,
                 device: Any = None, **engine_options: Any):
        super().__init__()
        del batch_size, max_batch_size, device  # lm-eval passes them to every model; the engine batches itself
        if (llm is None) == (pretrained is None):
            raise ConfigError("TesseraLM needs exactly one of pretrained= (a model directory) and llm= (an LLM)")
        self.llm = llm if llm is not None else LLM(pretrained, **engine_options)
        self.engine = self.llm.engine
        self.tokenizer = self.engine.tokenizer
        if self.tokenizer is None:
            raise ConfigError("lm-eval tasks are text: this model has no tokenizer (tokenizer.json); copy the "
                              "model's tokenizer files into its directory")
        if self.tokenizer.eos_id is None:
            raise ConfigError("lm-eval needs the tokenizer's eos_token (its end-of-text and prefix token); set it "
                              "in tokenizer_config.json")
        limit = self.engine.max_model_len
        if max_length is not None and not 1 < max_length <= limit:
            raise ConfigError(f"max_length={max_length} is invalid: must be in 2..{limit} (the engine's "
                              "max_model_len)")
        self._max_length = max_length or limit
        self._max_gen_toks = max_gen_toks

    # ---- what TemplateLM asks ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return (self.tokenizer.source or "tessera").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids; `add_special_tokens` None: its post-processor applies, unless the string
        already starts with the prefix token's text."""
        if add_special_tokens is None:
            prefix = self.tokenizer.decode([self.prefix_token_id])
            add_special_tokens = not (prefix and string.startswith(prefix))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        scored = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ConfigError("a loglikelihood request needs a context and a continuation of one token at least")
            if len(continuation) > self.max_length:
                raise ConfigError(f"a continuation of {len(continuation)} tokens is longer than max_length="
                                  f"{self.max_length}")
            whole = (context + continuation)[-(self.max_length + 1):]  # truncated on the left, as `hf` does
            scored.append(ScoreRequest(whole, len(continuation)))
        results = score_requests(self.engine, scored)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's whole log-likelihood, in windows of max_length tokens (lm-eval's rolling windows)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request on the engine at once; each stops at its `until` strings or the EOS token."""
        eos_text = self.tokenizer.decode([self.eot_token_id])
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_gen
            if room < 1:
                raise ConfigError(f"max_gen_toks={max_gen} leaves no room for a context in max_length="
                                  f"{self.max_length}")
            ids = self.tok_encode(context)[-room:]  # truncated on the left, as `hf` does
            prompts.append(ids)
            params.append(_sampling_params(kwargs, max_gen, [s for s in until if s and s != eos_text]))
            stops.append(until)
        outputs = self.llm.generate(prompts, params) if prompts else []
        texts = []
        for req, out, until in zip(requests, outputs, stops):
            text = postprocess_generated_text(out.text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts


def _sampling_params(kwargs: dict[str, Any], max_tokens: int, stop: list[str]) -> SamplingParams:
    """A task's remaining generation kwargs as the engine's SamplingParams: greedy unless do_sample,
    then temperature / top_p / top_k / seed as given. Other kwargs are refused by name."""
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
    kwargs.pop("temperature", None)
    top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
    top_k = int(kwargs.pop("top_k", 0) or 0)
    seed = kwargs.pop("seed", None)
    if kwargs:
        raise ConfigError(f"generation kwargs {sorted(kwargs)} are not supported by the tessera model; supported: "
                          "until, max_gen_toks, do_sample, temperature, top_p, top_k, seed")
    if len(stop) > 16:
        raise ConfigError(f"a task asks for {len(stop)} stop strings; the engine takes at most 16")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature if temperature > 0 else 0.0,
                          top_p=top_p, top_k=top_k, seed=seed, stop=stop)

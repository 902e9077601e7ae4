"""The serving engine: requests in, tokens out, one `step()` at a time.

A step asks the scheduler which sequences run and how many tokens each (continuous batching with
chunked prefill and a token budget), lets the speculative proposer guess tokens for the decoding
ones, runs the target model once over the packed batch on the paged KV cache, masks the logits of
requests under a JSON schema (`structured_output`; these decode without speculation), then samples
(or verifies the guesses), applies the stop rules and returns each request's new tokens and text.
Single-token queries (decodes) run through the static-shape decode step (`bucketed_decode`:
padded to a batch-size bucket, captured in a CUDA graph on the GPU), the rest through the packed
step; non-speculative sampling happens on the device for the whole step (`device_sampling`), so
that a decode step moves data to the host once: the new token ids and the finiteness flags.
Requests join and leave between steps. A request whose logits come out inf/NaN, whose sampling
fails, or whose schema the grammar engine cannot follow any further, is finished with an error on
its own; the rest of the batch carries on (`_fail_alone`).
The engine is not thread-safe: `EngineLoop` runs it in one background thread and hands it
requests through a queue.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from pathlib import Path

import torch

from tessera.config.errors import ConfigError
from tessera.infer.block_manager import BlockManager
from tessera.infer.config import EngineConfig
from tessera.infer.detokenizer import IncrementalDetokenizer
from tessera.infer.device_sampling import SamplingBatch, sample_on_device, tokens_to_host
from tessera.infer.lora import LoRAManager, merge_adapter
from tessera.infer.metrics import EngineMetrics
from tessera.infer.model_loading import eos_token_ids, load_model, load_tokenizer, torch_dtype
from tessera.infer.paged_model import BatchItem, build_paged_model
from tessera.infer.quant import quantize_model
from tessera.infer.rejection_sampling import verify_greedy, verify_sampled
from tessera.infer.sampling import make_generator, processed_probs
from tessera.infer.sampling_params import SamplingParams
from tessera.infer.scheduler import Scheduler
from tessera.infer.sequence import RequestOutput, Sequence, SequenceStatus
from tessera.infer.speculative import DraftModelProposer, PromptLookupProposer, Proposal
from tessera.infer.structured_output import GrammarCompiler, GrammarError, GrammarMatcher
from tessera.infer.tp_channel import TensorParallelRunner
from tessera.infer.tp_workers import start_workers_for_dir, start_workers_for_model
from tessera.models.transformer import Transformer

log = logging.getLogger("tessera.infer")


class LLMEngine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None, tokenizer=None,
                 eos_ids: set[int] | frozenset[int] = frozenset(), draft_model: Transformer | None = None,
                 workers=None):
        """`workers`: the other ranks of tensor-parallel serving (`tp_workers.WorkerGroup`), when
        `model` is this rank's shard of a model cut over them (`from_dir` / `from_model` start them)."""
        self.config = config = config or EngineConfig()
        self.model, self.cfg, self.tokenizer = model.eval(), model.cfg, tokenizer
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.eos_ids = frozenset(eos_ids)
        self.lora = LoRAManager(model, config.max_loras, self.dtype, self.device)
        runner, geometry = build_paged_model(model, config, self.lora)
        self.max_model_len, self.blocks_per_seq = geometry.max_model_len, geometry.blocks_per_seq
        num_blocks, bs, k = geometry.num_blocks, config.block_size, config.lookahead
        self.kv, self.decoder = runner.kv, runner.decoder
        self.blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, k)
        # tensor parallelism: the other ranks run every step with this one (tensor_parallel.py)
        self.runner = runner if workers is None else TensorParallelRunner(runner, workers)
        self.proposer = None
        spec = config.speculative
        if spec is not None and spec.method == "prompt_lookup":
            self.proposer = PromptLookupProposer(spec.num_tokens, spec.ngram_max, spec.ngram_min)
        elif spec is not None:
            if draft_model is None:
                raise ConfigError("speculative.method='draft' needs a draft model")
            self.proposer = DraftModelProposer(draft_model.eval(), self.cfg.vocab_size, spec.num_tokens, num_blocks,
                                               bs, self.dtype, self.device)
        self.grammars = GrammarCompiler(tokenizer, self.cfg.vocab_size, self.eos_ids)
        self.metrics = EngineMetrics()
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)

    # ---- construction from a directory -------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        """Load a HuggingFace / pre-quantized / Tessera-checkpoint directory and build the engine
        around it (`from_model`), with the directory's tokenizer and end-of-sequence ids."""
        config = config or EngineConfig()
        if config.tensor_parallel_size > 1:
            workers, model, run_cfg = start_workers_for_dir(path, config)
            try:
                tokenizer = load_tokenizer(path, run_cfg)
                return cls.from_model(model, config, tokenizer, eos_token_ids(path, tokenizer), workers=workers)
            except BaseException:
                workers.stop()
                raise
        model, quantized, run_cfg = load_model(path, torch_dtype(config.dtype), config.device)
        tokenizer = load_tokenizer(path, run_cfg)
        return cls.from_model(model, config, tokenizer, eos_token_ids(path, tokenizer),
                              prequantized=quantized is not None)

    @classmethod
    def from_model(cls, model: Transformer, config: EngineConfig | None = None, tokenizer=None,
                   eos_ids: set[int] | frozenset[int] = frozenset(), prequantized: bool = False,
                   workers=None) -> LLMEngine:
        """Build the engine around a model in memory, already in `config.dtype` on `config.device`
        (loaders keep some buffers in fp32, so the engine does not cast): static LoRA merged, int8
        applied, the draft model loaded, dynamic adapters loaded, system prompts cached.
        `prequantized`: the model's weights are int8 already. With tensor_parallel_size > 1 the
        model is cut over that many ranks here (its weights sent once to the new worker processes),
        unless `workers` says it is this rank's shard already."""
        config = config or EngineConfig()
        if config.tensor_parallel_size > 1 and workers is None:
            if prequantized:
                raise ConfigError("tensor_parallel_size > 1 needs full-precision weights; this model is int8")
            workers, model = start_workers_for_model(model, config)
            try:
                return cls.from_model(model, config, tokenizer, eos_ids, workers=workers)
            except BaseException:
                workers.stop()
                raise
        dtype = torch_dtype(config.dtype)
        weight = model.tok_embeddings.weight
        if weight.dtype != dtype or weight.device.type != torch.device(config.device).type:
            raise ConfigError(f"the model is {str(weight.dtype).removeprefix('torch.')} on {weight.device.type} but "
                              f"the engine is configured for dtype={config.dtype!r} on device={config.device!r}; "
                              "load the model that way or change the engine config")
        if config.merge_lora and prequantized:
            raise ConfigError("merge_lora needs full-precision weights; this directory is pre-quantized")
        for adapter in config.merge_lora:
            merge_adapter(model, adapter)
        if config.quantization == "int8" and not prequantized:
            quantize_model(model)
        draft = None
        if config.speculative is not None and config.speculative.method == "draft":
            draft = load_model(config.speculative.draft_model, dtype, config.device)[0]
        engine = cls(model, config, tokenizer, eos_ids, draft, workers)
        for name, adapter_path in config.lora_adapters.items():
            engine.load_lora(name, adapter_path)
        engine.warm_system_prompts(config.system_prompts)
        return engine

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, num_prompt_tokens: int, params: SamplingParams,
                         adapter: str | None) -> GrammarMatcher | None:
        """Raise ConfigError if the request cannot be served as asked. Returns the request's own
        grammar matcher (None for free text), which `add_request` keeps: compiling a schema again
        (after the compiled-grammar cache let it go) would stall the engine thread's batch."""
        if num_prompt_tokens < 1:
            raise ConfigError("prompt is empty: it needs at least one token")
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ConfigError(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                              f"has {num_prompt_tokens} prompt tokens + max_tokens={params.max_tokens}")
        if adapter is not None and adapter not in self.lora.adapters:
            raise ConfigError(f"lora adapter {adapter!r} is not loaded; loaded: {sorted(self.lora.adapters)}")
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer; this model directory has none (use stop_token_ids)")
        return self.grammars.matcher(params.response_format)  # an invalid schema is refused here, before queueing

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, adapter: str | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        grammar = self.validate_request(len(prompt_ids), params, adapter)
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is out of range 0..{self.cfg.vocab_size - 1}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ConfigError(f"request_id {request_id!r} is already in use")
        generator, seed = None, 0
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
            generator = make_generator(seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        seq = Sequence(request_id, prompt_ids, params, generator, adapter=adapter,
                       adapter_key=self.lora.adapters[adapter].key if adapter else b"", stop_ids=frozenset(stop_ids),
                       grammar=grammar, seed=seed)
        self.seqs[request_id] = seq
        self.detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        self.metrics.prompt_tokens += len(prompt_ids)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        return None if seq is None else self._finish(seq, "abort", [])

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with an error (at shutdown)."""
        return [self._finish(seq, "error", [], message) for seq in list(self.seqs.values())]

    def fail_running(self, message: str) -> list[RequestOutput]:
        """After an exception inside a step that no single request can be blamed for (the batch's
        forward pass): finish the requests that were running with an error; the waiting ones
        have not been touched and stay queued. Fails every request if none was running, so a
        failure while admitting cannot repeat forever."""
        running = list(self.scheduler.running)
        if not running:
            return self.fail_all(message)
        return [self._finish(seq, "error", [], message) for seq in running]

    # ---- LoRA --------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path, weights: dict | None = None) -> None:
        """Load the adapter at `path` under `name`; `weights` when already read (`read_adapter`)."""
        if self.config.tensor_parallel_size > 1:
            raise ConfigError(f"LoRA adapters are not supported with tensor_parallel_size="
                              f"{self.config.tensor_parallel_size}; serve them with tensor_parallel_size=1")
        self.lora.load(name, path, weights)

    def unload_lora(self, name: str) -> None:
        users = sum(1 for s in self.seqs.values() if s.adapter == name)
        if users:
            raise ConfigError(f"lora {name!r} is in use by {users} request(s); unload it when they finish")
        self.lora.unload(name)

    # ---- system prompts ----------------------------------------------------------------------
    def warm_system_prompts(self, prompts: list[str]) -> None:
        """Prefill each system prompt once and pin its full blocks in the prefix cache."""
        if not prompts:
            return
        if self.tokenizer is None or not self.config.enable_prefix_caching:
            raise ConfigError("system_prompts need a tokenizer and enable_prefix_caching=True")
        for text in prompts:
            ids = self.tokenizer.encode(text)[: self.max_model_len - 1]
            rid = self.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            self.seqs[rid].pin_prefix = True
        while self.has_unfinished():
            self.step()
        left = self.blocks.num_blocks - self.blocks.num_pinned_blocks
        if left < self.blocks_per_seq:
            raise ConfigError(f"system prompts pin {self.blocks.num_pinned_blocks} blocks, leaving {left}; one "
                              f"sequence needs {self.blocks_per_seq}: raise num_blocks or shorten them")

    # ---- the step ----------------------------------------------------------------------------
    def _draft_limit(self, seq: Sequence) -> int:
        remaining = seq.params.max_tokens - len(seq.output_ids) - 1
        return max(0, min(self.config.lookahead, remaining, self.max_model_len - len(seq.token_ids) - 1))

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        plan = self.scheduler.schedule()
        for victim in plan.preempted:
            self.metrics.preemptions += 1
            if self.proposer is not None:
                self.proposer.release(victim)
        if not plan.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:  # cannot fit even alone
                seq = self.scheduler.waiting[0]
                outputs.append(self._finish(seq, "error", [], "the request needs more KV-cache blocks than exist"))
            return outputs
        self.metrics.steps += 1
        proposals: dict[str, Proposal] = {}
        # a request with a grammar decodes one token per step: its proposals would go unmasked
        spec = [s.seq for s in plan.scheduled if s.speculate and s.seq.grammar is None]
        if spec and self.proposer is not None:
            props = self.proposer.propose(spec, [self._draft_limit(s) for s in spec])
            proposals = {s.request_id: p for s, p in zip(spec, props) if p.tokens}
        items = []
        for s in plan.scheduled:
            seq = s.seq
            tokens = seq.token_ids[seq.num_computed:seq.num_computed + s.num_tokens]
            if seq.request_id in proposals:
                tokens = tokens + proposals[seq.request_id].tokens
            slot = self.lora.adapters[seq.adapter].slot if seq.adapter else -1
            read_from = s.num_tokens - 1 if s.completes else len(tokens)  # the rows sampled / verified below
            items.append(BatchItem(tokens, seq.num_computed, seq.block_table, slot, read_from))
        logits, offsets = self.runner.forward_split(items)
        # rows each completing request samples from: its last computed position (and its proposals)
        spans = [range(o + s.num_tokens - 1, o + len(it.tokens)) if s.completes else range(0)
                 for s, it, o in zip(plan.scheduled, items, offsets)]
        finite = self._finite_rows(logits, spans)  # before the grammar masks put -inf in
        self._apply_grammars(logits, plan.scheduled, spans)
        plain = [i for i, s in enumerate(plan.scheduled) if s.completes and s.seq.request_id not in proposals]
        # greedy requests verify their proposals against the argmax of their rows, which travels
        # with the sampled tokens; sampled ones draw on the host (rejection_sampling.verify_sampled)
        greedy = [i for i, s in enumerate(plan.scheduled)
                  if s.seq.request_id in proposals and s.seq.params.greedy]
        host = self._to_host(logits, [plan.scheduled[i].seq for i in plain], [spans[i][-1] for i in plain],
                             [r for i in greedy for r in spans[i]], finite)
        sampled = dict(zip(plain, host[:len(plain)]))
        at = len(plain)
        argmax: dict[int, list[int]] = {}
        for i in greedy:
            argmax[i] = host[at:at + len(spans[i])]
            at += len(spans[i])
        finite_rows = host[at:]
        flag_at = 0
        for i, s in enumerate(plan.scheduled):
            seq, span = s.seq, spans[i]
            ok = all(finite_rows[flag_at:flag_at + len(span)])
            flag_at += len(span)
            if not s.completes:
                seq.num_computed += s.num_tokens
            else:
                proposal = proposals.get(seq.request_id)
                try:
                    if not ok:
                        raise FloatingPointError("the model produced inf/NaN logits for this request")
                    if proposal is None:
                        new = [sampled[i]]
                    elif i in argmax:
                        new = verify_greedy(argmax[i], proposal.tokens)
                    else:
                        new = verify_sampled(processed_probs(logits[span.start:span.stop], seq.params),
                                             proposal.tokens, proposal.probs, seq.generator)
                    if seq.grammar is not None:
                        seq.grammar.advance(new)
                except Exception as e:  # this request's numbers or grammar went wrong: it alone fails
                    outputs.append(self._fail_alone(seq, e))
                    continue
                seq.num_computed += s.num_tokens + len(new) - 1
                if proposal is not None:
                    self.proposer.rollback(seq)
                    self.metrics.spec_steps += 1
                    self.metrics.spec_proposed += len(proposal.tokens)
                    self.metrics.spec_accepted += len(new) - 1
                    self.metrics.spec_emitted += len(new)
                outputs.append(self._emit(seq, new))
            if not seq.finished:
                self.blocks.register_computed(seq)
        return outputs

    @staticmethod
    def _finite_rows(logits_TV: torch.Tensor, spans: list[range]) -> torch.Tensor:
        """[R] int64 on the device, 1 where a sampled logits row is finite (in the order of `spans`)."""
        index = [r for span in spans for r in span]
        if not index:
            return logits_TV.new_zeros(0, dtype=torch.long)
        rows = torch.tensor(index).to(logits_TV.device, non_blocking=True)
        return torch.isfinite(logits_TV.index_select(0, rows)).all(-1).long()

    def _to_host(self, logits_TV: torch.Tensor, seqs: list[Sequence], rows: list[int], argmax_rows: list[int],
                 finite_R: torch.Tensor) -> list[int]:
        """The step's one device -> host transfer: [tokens..., argmaxes..., flags...]. Samples the
        next token of each of `seqs` from its logits row on the device, and takes the argmax of
        each of `argmax_rows` (greedy requests' verification rows)."""
        parts = []
        if seqs:
            index = torch.tensor(rows).to(logits_TV.device, non_blocking=True)
            batch = SamplingBatch.build([(s.params, s.seed, len(s.output_ids)) for s in seqs], logits_TV.shape[-1],
                                        logits_TV.device)
            parts.append(sample_on_device(logits_TV.index_select(0, index), batch))
        if argmax_rows:
            index = torch.tensor(argmax_rows).to(logits_TV.device, non_blocking=True)
            parts.append(logits_TV.index_select(0, index).argmax(-1))
        if finite_R.numel():
            parts.append(finite_R)
        # a step of prefill chunks only transfers nothing
        return tokens_to_host(torch.cat(parts)) if parts else []

    def _apply_grammars(self, logits_TV: torch.Tensor, scheduled: list, spans: list[range]) -> None:
        """Mask, on the device, the logits row that each sequence with a grammar samples from this
        step (after the finiteness check, which the -inf of the mask would fail)."""
        rows, grammars = [], []
        for s, span in zip(scheduled, spans):
            if s.completes and s.seq.grammar is not None:
                rows.append(span[0])
                grammars.append(s.seq.grammar)
        self.grammars.mask_logits(logits_TV, rows, grammars)

    def _fail_alone(self, seq: Sequence, error: Exception) -> RequestOutput:
        """Finish one request whose numbers or grammar went wrong, leaving the rest of the batch
        running. A grammar failure is the request's own (its schema): its KV blocks are sound and
        stay as they are. Otherwise the KV blocks only it holds are zeroed first (a stale inf/NaN
        slot would poison the next owner of the block, since attention multiplies even masked-out
        values by zero weight) and taken out of the prefix cache (a later prompt must recompute
        them, not reuse zeros)."""
        log.warning("request %s failed alone: %s: %s", seq.request_id, type(error).__name__, error)
        if isinstance(error, GrammarError):
            return self._finish(seq, "error", [], str(error), client_error=True)
        own = [b for b in seq.block_table if self.blocks.ref[b] == 1]
        self.runner.clear_blocks(own)
        if self.blocks.cache is not None:
            for b in own:
                self.blocks.cache.forget(b)
        return self._finish(seq, "error", [], f"numerical error: {error}")

    def _emit(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append `tokens` one by one until a stop rule fires; the output of this step."""
        detok, params = self.detok[seq.request_id], seq.params
        appended, reason = [], None
        for tok in tokens:
            seq.token_ids.append(tok)
            appended.append(tok)
            if tok in seq.stop_ids:
                reason = "stop"
            elif detok.add(tok) or (seq.grammar is not None and seq.grammar.finished):
                reason = "stop"
            elif len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.arrival)
        self.metrics.generation_tokens += len(appended)
        if reason:
            return self._finish(seq, reason, appended)
        delta = detok.release(final=False)
        return RequestOutput(seq.request_id, appended, delta, detok.text[:detok.sent], seq.output_ids, False, None,
                             seq.num_prompt)

    def _finish(self, seq: Sequence, reason: str, appended: list[int], error: str | None = None,
                client_error: bool = False) -> RequestOutput:
        if seq.pin_prefix:
            self.blocks.register_computed(seq)
            self.blocks.pin_sequence(seq)
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        n_out = len(seq.output_ids)
        if reason in ("stop", "length") and seq.first_token_time is not None and n_out > 1:
            self.metrics.tpot.observe((time.monotonic() - seq.first_token_time) / (n_out - 1))
        self.metrics.finish(reason)
        detok = self.detok.pop(seq.request_id)
        delta = detok.release(final=True)
        del self.seqs[seq.request_id]
        return RequestOutput(seq.request_id, appended, delta, detok.text, seq.output_ids, True, reason, seq.num_prompt,
                             error, client_error)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one process). The engine cannot
        step afterwards."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ---- introspection -----------------------------------------------------------------------
    @property
    def failure(self) -> Exception | None:
        """Why this engine can no longer step (a tensor-parallel rank failed, or a step was
        interrupted and left the ranks out of step); None while it can."""
        return getattr(self.runner, "failure", None)

    def gauges(self) -> dict[str, float]:
        return {"num_requests_running": len(self.scheduler.running),
                "num_requests_waiting": len(self.scheduler.waiting), "kv_blocks_total": self.blocks.num_blocks,
                "kv_blocks_free": self.blocks.num_free_blocks,
                "kv_blocks_pinned": self.blocks.num_pinned_blocks}

    def prometheus(self) -> str:
        cache = self.blocks.cache
        return self.metrics.prometheus(self.gauges(), cache.queried_tokens if cache else 0,
                                       cache.hit_tokens if cache else 0)

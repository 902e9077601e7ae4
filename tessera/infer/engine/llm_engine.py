"""The serving engine: requests in, tokens out, one `step()` at a time.

A step is three calls (`step_outputs.py` spells out what they hand each other): the scheduler
picks the sequences that run and how many tokens each (continuous batching with chunked prefill
and a token budget, `scheduler.py`); the executor runs the model on every rank and the model runner
samples, drafting and verifying speculative tokens (`executor.py`, `model_runner.py`); the scheduler
then applies the results: stop rules, text, finished requests, prefix-cache blocks. Requests join
and leave between steps. A request whose logits come out inf/NaN, or whose schema the grammar
engine cannot follow any further, is finished with an error on its own; the rest of the batch
carries on. The engine is not thread-safe: `EngineLoop` runs it in one background thread and hands
it requests through a queue.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import numpy as np
import torch

from tessera.checkpoint.gguf.reader import is_gguf_path
from tessera.checkpoint.loading import (
    eos_token_ids,
    is_vision_language,
    keeps_stored_blocks,
    load_model,
    load_vision_language,
    model_tokenizer,
    trained_tokenizer,
    vision_language_family,
)
from tessera.checkpoint.vision_families import default_processor
from tessera.config.errors import ConfigError, RequestError
from tessera.data.image_processor import decode_image
from tessera.data.tokenizer import Tokenizer, load_tokenizer
from tessera.infer.config import EngineConfig
from tessera.infer.cpu.gguf_layer import fuse_gguf_layers
from tessera.infer.cpu.gguf_matmul import use_block_kernels
from tessera.infer.cpu.layer_ops import fuse_layer_ops
from tessera.infer.cpu.linear import can_pack, fuse_projections, pack_linears
from tessera.infer.cpu.quant_matmul import use_quant_kernels
from tessera.infer.engine.checked_request import CheckedRequest
from tessera.infer.engine.metrics import EngineMetrics
from tessera.infer.engine.output_processor import OutputProcessor
from tessera.infer.engine.sequence import RequestOutput, Sequence
from tessera.infer.engine.step_profile import EngineProfile
from tessera.infer.runner.executor import Executor, InProcessExecutor, closed_on_error
from tessera.infer.runner.lora import merge_adapter
from tessera.infer.runner.multimodal import ImageEncoder, expand_placeholders
from tessera.infer.sampling.params import SamplingParams
from tessera.infer.sampling.sampler import make_generator
from tessera.infer.sampling.structured_output import GrammarCompiler, GrammarMatcher
from tessera.infer.scheduling.block_manager import engine_blocks
from tessera.infer.scheduling.kv_exchange import KVExchange
from tessera.infer.scheduling.kv_tier_planner import KVTierPlanner
from tessera.infer.scheduling.kv_tiers import TierMetrics
from tessera.infer.scheduling.recurrent_state import prefix_caching
from tessera.infer.scheduling.scheduler import Scheduler
from tessera.models.quantized import quantize_model
from tessera.models.stored_quant import stored_quant_method
from tessera.models.transformer import Transformer
from tessera.models.vision.vision_language import VisionLanguageModel


class LLMEngine:
    def __init__(self, executor: Executor, config: EngineConfig, tokenizer=None,
                 eos_ids: set[int] | frozenset[int] = frozenset()):
        """The engine around `executor`'s model (`from_dir` / `from_model` build both)."""
        self.executor, self.config = executor, config
        self.model, self.cfg, self.tokenizer = executor.model.eval(), executor.model.cfg, tokenizer
        self.lora = executor.lora
        self.eos_ids = frozenset(eos_ids)
        self.max_model_len, self.blocks_per_seq = executor.geometry.max_model_len, executor.geometry.blocks_per_seq
        store = executor.kv_tiers  # the KV tiers' bytes, built by the executor over its cache
        self.tier_metrics = store.metrics if store is not None else TierMetrics()
        planner = KVTierPlanner.over(store) if store is not None else None
        snapshots = executor.runner.snapshots  # a hybrid model's recurrent-state snapshots (state_snapshots.py)
        self.blocks = engine_blocks(executor.geometry, config, planner,
                                    prefix_caching(executor.model.cfg, config.enable_prefix_caching,
                                                   0 if snapshots is None else snapshots.num_snapshots), snapshots)
        self.kv_exchange = KVExchange(executor, self.blocks, self.tier_metrics)  # for kv_transfer.py
        self.metrics = EngineMetrics()
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.lookahead,
                                   OutputProcessor(tokenizer, self.max_model_len, self.metrics),
                                   config.scheduling_policy)
        self.grammars = GrammarCompiler(tokenizer, self.cfg.vocab_size, self.eos_ids)
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._asleep = False  # `sleep`: the KV cache released until `wake`
        self.vision: VisionLanguageModel | None = None  # a vision-language model whose language model it serves
        self.image_processor = None  # that model's image processor (its family's: pixel values of an image)
        self.profile: EngineProfile | None = None  # `tessera serve --profile-dir`: steps recorded (step_profile.py)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        """Load a HuggingFace / pre-quantized / Tessera-checkpoint directory and build the engine
        around it, with the directory's tokenizer and end-of-sequence ids."""
        config = config or EngineConfig()
        if is_vision_language(path):
            config.check_vision_language(vision_language_family(path))
            model, processor, run_cfg = load_vision_language(path, config.torch_dtype, config.device)
            tokenizer = served_tokenizer(path, run_cfg)
            return cls.from_model(model, config, tokenizer, eos_token_ids(path, tokenizer, model.cfg.text.vocab_size),
                                  image_processor=processor)
        if config.gguf_keep_quantized is None and keeps_stored_blocks(path):  # settled as loaded (load_lora reads it)
            config = dataclasses.replace(config, gguf_keep_quantized=config.gguf_blocks_kept(True))
        if config.kv_cache_dtype is None and is_gguf_path(path):  # int8 on the CPU (EngineConfig.kv_cache_dtype_for)
            config = dataclasses.replace(config, kv_cache_dtype=config.kv_cache_dtype_for(True))
        if config.tensor_parallel_size == 1:
            model, quantized, run_cfg = load_model(path, config.torch_dtype, config.device,
                                                   bool(config.gguf_keep_quantized))
            tokenizer = served_tokenizer(path, run_cfg)
            return cls.from_model(model, config, tokenizer, eos_token_ids(path, tokenizer, model.cfg.vocab_size),
                                  prequantized=quantized is not None, owned=True)
        from tessera.infer.runner.tp_executor import TensorParallelExecutor  # cuts through DTensor: not on one rank

        executor, run_cfg = TensorParallelExecutor.start_for_dir(path, config)
        with closed_on_error(executor.close):
            tokenizer = served_tokenizer(path, run_cfg)
            eos_ids = eos_token_ids(path, tokenizer, executor.model.cfg.vocab_size)
            return cls._serving(executor, config, tokenizer, eos_ids)

    @classmethod
    def from_model(cls, model: Transformer | VisionLanguageModel, config: EngineConfig | None = None, tokenizer=None,
                   eos_ids: set[int] | frozenset[int] = frozenset(), prequantized: bool = False,
                   image_processor=None, owned: bool = False) -> LLMEngine:
        """Build the engine around a model in memory, already in `config.dtype` on `config.device`
        (loaders keep some buffers in fp32, so the engine does not cast): static LoRA merged, weights
        quantized, the draft model loaded, dynamic adapters loaded, system prompts cached.
        `prequantized`: the model's weights are int8 already (a pre-quantized directory). With
        tensor_parallel_size > 1 the model is cut over that many ranks (its weights sent once to
        the new worker processes). A vision-language model (`VisionLanguageModel`) is served as its
        language model with its image encoder beside it (`image_processor`: the one its tower ships
        with by default).
        `owned`: the engine alone holds `model` (loaded for it), so its projections may be packed for
        the CPU (infer/cpu/linear.py), its norms, rotary embedding and activation done by one-pass kernels
        (infer/cpu/layer_ops.py), its GGUF block matrices multiplied as blocks (infer/cpu/gguf_matmul.py)
        and its int8 / int4 / compressed-tensors layers by their codes (infer/cpu/quant_matmul.py);
        a model shared with a trainer never is."""
        config = config or EngineConfig()
        if isinstance(model, VisionLanguageModel):
            return cls._serving_vision_language(model, config, tokenizer, eos_ids, image_processor)
        _check_placement(model, config)
        if config.tensor_parallel_size == 1:
            _prepare_weights(model, config, prequantized)
            if owned and config.cpu_prepack and can_pack(config.device, config.torch_dtype):
                pack_linears(model)
                fuse_projections(model)
                fuse_layer_ops(model)
                use_block_kernels(model)
                fuse_gguf_layers(model)
                use_quant_kernels(model)
            return cls._serving(InProcessExecutor(model, config), config, tokenizer, eos_ids)
        if prequantized:
            raise ConfigError("tensor_parallel_size > 1 needs full-precision weights; this model is int8")
        from tessera.infer.runner.tp_executor import TensorParallelExecutor

        return cls._serving(TensorParallelExecutor.start_for_model(model, config), config, tokenizer, eos_ids)

    @classmethod
    def from_group_shard(cls, model: Transformer, config: EngineConfig, tokenizer, eos_ids, group) -> LLMEngine:
        """Serve `model`, this rank's tensor-parallel shard (plain tensors, `runner.tp_shared.alias_shards`),
        on rank 0 of the running process `group`, whose other ranks call `tp_shared.serve_group_steps`
        meanwhile; `close()` releases them (config.tensor_parallel_size is the group's size). Before the
        first step every rank of the group says whether its part was built (`agreed_build`): a failure on
        any of them, this one's or a peer's, raises on all at once with that rank's reason, and nothing
        is stepped (the peers start serving only once all have built)."""
        from tessera.infer.runner.tp_executor import TensorParallelExecutor
        from tessera.infer.runner.tp_shared import GroupPeers, agreed_build

        peers = GroupPeers(group)
        engine, error = None, None
        try:
            executor = TensorParallelExecutor(peers, model, config)
            with closed_on_error(executor.close):  # the peers do not serve yet: closing sends nothing
                engine = cls(executor, config, tokenizer, eos_ids)
        except Exception as e:
            error = e
        with closed_on_error(lambda: engine is not None and engine.close()):
            agreed_build(group, error)
            peers.serving = True
            engine.warm_system_prompts(config.system_prompts)
        return engine

    @classmethod
    def _serving_vision_language(cls, model: VisionLanguageModel, config: EngineConfig, tokenizer, eos_ids,
                                 image_processor) -> LLMEngine:
        config.check_vision_language(model.family)
        _check_placement(model.language_model, config)
        encoder = ImageEncoder(model, config.device, config.mm_encoder_cache_images)
        engine = cls._serving(InProcessExecutor(model.language_model, config, encoder=encoder), config, tokenizer,
                              eos_ids)
        engine.vision = model
        engine.image_processor = image_processor or default_processor(model.cfg)
        return engine

    @classmethod
    def _serving(cls, executor: Executor, config: EngineConfig, tokenizer, eos_ids) -> LLMEngine:
        """The engine around `executor`, its dynamic adapters loaded and system prompts cached
        (the executor closed if that fails)."""
        with closed_on_error(executor.close):
            engine = cls(executor, config, tokenizer, eos_ids)
            for name, adapter_path in config.lora_adapters.items():
                engine.load_lora(name, adapter_path)
            engine.warm_system_prompts(config.system_prompts)
            return engine

    # ---- requests ----------------------------------------------------------------------------
    def validate_request(self, num_prompt_tokens: int, params: SamplingParams,
                         adapter: str | None) -> GrammarMatcher | None:
        """Raise RequestError (a ConfigError naming the request field at fault) if a prompt of
        `num_prompt_tokens` cannot be served as asked. Returns the request's own grammar matcher
        (None for free text), which `add_request` keeps: compiling a schema again (after the
        compiled-grammar cache let it go) would stall the engine thread's batch."""
        if num_prompt_tokens < 1:
            raise RequestError("prompt is empty: it needs at least one token", field="prompt")
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens; the request "
                               f"has {num_prompt_tokens} prompt tokens + max_tokens={params.max_tokens}",
                               field="prompt")
        self._loaded_adapter(adapter)
        bad = [t for t in params.logit_bias if t >= self.cfg.vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is out of range 0..{self.cfg.vocab_size - 1}",
                               field="logit_bias")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model directory has none (use stop_token_ids)",
                               field="stop")
        # an invalid schema or grammar is refused here, before queueing
        if params.guided_grammar is not None:
            return self.grammars.lark_matcher(params.guided_grammar)
        return self.grammars.matcher(params.response_format)

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None, adapter: str | None = None,
                      images: list[np.ndarray] | None = None) -> CheckedRequest:
        """The one check of a request (checked_request.py): its images against the prompt's marks
        (`with_images`), its token ids, then `validate_request`. RequestError naming the field at fault."""
        params = params or SamplingParams()
        try:
            prompt_ids, prompt_images = self.with_images([int(t) for t in prompt_ids], images or [])
        except RequestError:
            raise
        except ConfigError as e:
            raise RequestError(str(e), field="images") from None
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in 0..{self.cfg.vocab_size - 1} (token id {bad[0]} is not)",
                               field="prompt")
        grammar = self.validate_request(len(prompt_ids), params, adapter)
        return CheckedRequest(prompt_ids, params, adapter, prompt_images, grammar)

    def add_request(self, prompt_ids: list[int] | CheckedRequest, params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    images: list[np.ndarray] | None = None) -> str:
        """Queue a request: `prompt_ids` with its `params`, `adapter` and `images` (pixel values
        [C, H, W], `image_processor`'s output, of the images the prompt marks, one image token id per
        image, in order: multimodal.py), checked here (`check_request`); or a request checked already,
        queued as it is (the other arguments but `request_id` unused)."""
        request = (prompt_ids if isinstance(prompt_ids, CheckedRequest)
                   else self.check_request(prompt_ids, params, adapter, images))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise ConfigError(f"request_id {request_id!r} is already in use")
        loaded = self._loaded_adapter(request.adapter)  # unloaded since a check in another thread: refused
        params = request.params
        generator, seed = None, 0
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
            generator = make_generator(seed)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        seq = Sequence(request_id, request.prompt_ids, params, generator, adapter=request.adapter,
                       adapter_key=loaded.key if loaded else b"", adapter_slot=loaded.slot if loaded else -1,
                       stop_ids=frozenset(stop_ids), grammar=request.grammar, seed=seed, images=request.images)
        self.scheduler.add(seq)
        return request_id

    def _loaded_adapter(self, name: str | None):
        """The loaded LoRA adapter `name` (None for the base model); RequestError when it is not loaded."""
        if name is None:
            return None
        if name not in self.lora.adapters:
            raise RequestError(f"lora adapter {name!r} is not loaded; loaded: {sorted(self.lora.adapters)}",
                               field="adapter")
        return self.lora.adapters[name]

    def with_images(self, prompt_ids: list[int], images: list[np.ndarray]) -> tuple[list[int], tuple]:
        """The prompt with its image marks widened to placeholders, and its images (none for text);
        ConfigError when the images are too many, of the wrong size, or do not match the marks."""
        self.config.check_media_count("image", len(images))
        if self.vision is None:
            if images:
                raise ConfigError("this model takes no images (it is not a vision-language model)")
            return prompt_ids, ()
        inputs = [self.vision.image_input(p) for p in images]  # each checked as its family takes it
        return expand_placeholders(prompt_ids, self.vision.image_token_id, [i.tokens for i in inputs],
                                   [i.pixels for i in inputs], [i.grid for i in inputs])

    def pixel_values(self, image) -> np.ndarray | tuple[np.ndarray, tuple[int, int, int]]:
        """The model's pixel values of `image`: a PIL image, or encoded bytes (decoded as untrusted input).
        Qwen2-VL: its patch rows and (t, h, w) grid (what the family's `image_input` takes)."""
        if self.image_processor is None:
            raise ConfigError("this model takes no images (it is not a vision-language model)")
        return self.image_processor(decode_image(image) if isinstance(image, bytes | bytearray) else image)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- sleep and wake ----------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Release the paged KV cache's memory while the engine is not used (between the rollout
        phases of a GRPO run, whose training step then has it); `wake` allocates it again. The prefix
        cache is emptied: its blocks' contents go (and the weights may change before `wake`). Only
        with no unfinished request, in one process, without pinned system prompts or KV tiers."""
        if self.sleeping:
            return
        if not isinstance(self.executor, InProcessExecutor) or self.executor.kv_tiers is not None:
            raise ConfigError("sleep() needs the engine in one process without KV tiers "
                              "(tensor_parallel_size=1, kv_offload_gib=0, no kv_cache_dir)")
        if self.has_unfinished() or self.blocks.num_pinned_blocks:
            raise ConfigError("sleep() needs an idle engine: no unfinished request and no pinned system prompt")
        self.blocks.drop_cached()
        self.kv.release()
        self._asleep = True

    def wake(self) -> None:
        """Allocate the KV cache `sleep` released (empty); nothing to do when it is awake."""
        if self.sleeping:
            self.kv.reclaim()
            self._asleep = False

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with an error (at shutdown)."""
        return self.scheduler.fail_all(message)

    def fail_running(self, message: str) -> list[RequestOutput]:
        """Finish the running requests with an error after a step failed (`Scheduler.fail_running`)."""
        return self.scheduler.fail_running(message)

    # ---- LoRA --------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path, weights: dict | None = None) -> None:
        """Load the adapter at `path` under `name`; `weights` when already read (`read_adapter`)."""
        self.config.check_runtime_lora()  # one rank, weights dequantized at load: the config's rule
        if self.vision is not None:
            raise ConfigError(f"LoRA adapters are not supported for the vision-language model family "
                              f"{self.vision.family!r}")
        self.lora.load(name, path, weights)

    def unload_lora(self, name: str) -> None:
        users = sum(1 for s in self.scheduler.requests.values() if s.adapter == name)
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
        for i, text in enumerate(prompts):
            ids = self.tokenizer.encode(text)
            if len(ids) >= self.max_model_len:  # a request after it needs room for at least one token more
                raise ConfigError(f"system prompt {i + 1} is {len(ids)} tokens; with max_model_len="
                                  f"{self.max_model_len} it may be at most {self.max_model_len - 1}: shorten it "
                                  "or raise max_model_len")
            rid = self.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            self.scheduler.requests[rid].pin_prefix = True
        while self.has_unfinished():
            self.step()
        left = self.blocks.num_blocks - self.blocks.num_pinned_blocks
        if left < self.blocks_per_seq:
            raise ConfigError(f"system prompts pin {self.blocks.num_pinned_blocks} blocks, leaving {left}; one "
                              f"sequence needs {self.blocks_per_seq}: raise num_blocks or shorten them")

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: the scheduler's plan, run by the executor, its results applied by the
        scheduler. The KV blocks a request failing on inf/NaN leaves are zeroed on every rank before
        the next step can hand them to another request, also when applying the results raised."""
        if self.sleeping:
            raise ConfigError("the engine sleeps (its KV cache is released): call wake() before stepping it")
        if self.profile is not None and self.profile.recording:
            return self.profile.timed_step(self)
        plan = self.scheduler.schedule()
        result = self.executor.execute_model(plan)
        try:
            return self.scheduler.update_from_output(plan, result).outputs
        finally:
            self.executor.clear_blocks(self.scheduler.take_dirty_blocks())

    def flush_kv_transfers(self) -> None:
        """Make the copies between KV tiers planned so far. Steps do it before their forward; callers
        that take blocks outside a step (perplexity, evaluation scoring) do it before theirs, since
        the blocks they took may hold a prefix that must reach the host tier first."""
        self.executor.apply_kv_transfers(self.scheduler.take_kv_transfers())

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one process). The engine cannot
        step afterwards. Blocks of finished requests not yet written to the disk tier are written first."""
        try:
            if self.executor.failure is None:
                self.flush_kv_transfers()
        finally:
            self.executor.close()

    # ---- introspection -----------------------------------------------------------------------
    @property
    def runner(self):
        """The model runner that samples (`executor.runner`)."""
        return self.executor.runner

    @property
    def kv(self):
        """This process's paged KV cache (under tensor parallelism rank 0's heads)."""
        return self.executor.local.kv

    @property
    def decoder(self):
        """This process's static-shape decode step (None without one)."""
        return self.executor.local.decoder

    @property
    def failure(self) -> Exception | None:
        """Why this engine can no longer step (a tensor-parallel rank failed, or a step was
        interrupted and left the ranks out of step); None while it can."""
        return self.executor.failure

    def gauges(self) -> dict[str, float]:
        return {"num_requests_running": len(self.scheduler.running),
                "num_requests_waiting": len(self.scheduler.waiting), "kv_blocks_total": self.blocks.num_blocks,
                "kv_blocks_free": self.blocks.num_free_blocks,
                "kv_blocks_pinned": self.blocks.num_pinned_blocks}

    def prometheus(self) -> str:
        cache = self.blocks.cache
        page = self.metrics.prometheus(self.gauges(), cache.queried_tokens if cache else 0,
                                       cache.hit_tokens if cache else 0)
        if not self.config.has_kv_tiers and self.config.kv_role is None:
            return page
        return page + "\n".join(self.tier_metrics.prometheus_lines()) + "\n"


def _check_placement(model: Transformer, config: EngineConfig) -> None:
    weight = next(model.parameters())  # the embedding's, or where it is kept as GGUF blocks, a norm's
    if weight.dtype != config.torch_dtype or weight.device.type != torch.device(config.device).type:
        raise ConfigError(f"the model is {str(weight.dtype).removeprefix('torch.')} on {weight.device.type} but "
                          f"the engine is configured for dtype={config.dtype!r} on device={config.device!r}; "
                          "load the model that way or change the engine config")


def _prepare_weights(model: Transformer, config: EngineConfig, prequantized: bool) -> None:
    """Static LoRA adapters merged into the weights, then quantized (config.quantization), as
    `config` asks. A pre-quantized int8 model takes no other method, one in a checkpoint's own
    format (tessera/models/stored_quant.py) none."""
    if config.merge_lora and prequantized:
        raise ConfigError("merge_lora needs full-precision weights; this directory is pre-quantized")
    stored = stored_quant_method(model) if prequantized else None
    if prequantized and config.quantization not in (None, "int8" if stored is None else None):
        raise ConfigError(f"quantization={config.quantization!r} needs full-precision weights; this directory is "
                          f"pre-quantized {stored or 'int8'} (serve it without --quantization, or serve its "
                          "full-precision source)")
    for adapter in config.merge_lora:
        merge_adapter(model, adapter)
    if config.quantization and not prequantized:
        quantize_model(model, config.quantization)


def served_tokenizer(path: str | Path, run_cfg: dict | None) -> Tokenizer | None:
    """The tokenizer a served model was trained with (`trained_tokenizer`), or None when it has
    none (then only token-id prompts work). For a Tessera checkpoint (`run_cfg`, its stored run
    configuration) a tokenizer that cannot be read is None too: the one the run named may be gone
    from this machine, or the bundled one absent from a source checkout."""
    if run_cfg is None:  # a model directory (its own tokenizer.json, or none) or a GGUF file (its metadata's)
        return model_tokenizer(path)
    try:
        return load_tokenizer(trained_tokenizer(path))
    except Exception:  # noqa: BLE001 - any unreadable tokenizer: serve token ids only
        return None


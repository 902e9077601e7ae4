"""Serving engine configuration: cache geometry, batching limits, and the optional features
(prefix reuse, speculative decoding, LoRA, weight quantization), one documented field at a time.

Each field that `tessera serve` (and `eval`, `generate`) can set declares its option where it is
declared (`tessera.config.flags`): help, default, choices and converter in one place;
`EngineConfig.add_arguments` and `EngineConfig.from_args` are the commands' only way to them.
Every field is validated in `__post_init__`, and every refusal of two fields together lives here
too; a bad value raises `ConfigError` naming the key, the value and what is allowed (and, for
two options refused together, the command-line spelling of both).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tessera.config.argument_types import int_in, nonnegative_float, positive_float, seed, text
from tessera.config.devices import resolve_device
from tessera.config.dtypes import DTYPES, dtype_argument, dtype_name, torch_dtype
from tessera.config.errors import ConfigError, RequestError, require
from tessera.config.flags import add_flags, flag, flag_text, section, values_from_args
from tessera.config.limits import MAX_KV_BLOCKS, MAX_KV_CACHE_GIB
from tessera.infer.engine_arguments import MODALITIES, batch_sizes, mm_limits, named_adapters

SPECULATIVE_METHODS = ("draft", "prompt_lookup", "mtp", "eagle")
QUANTIZATION_METHODS = ("int8", "fp8", "int4")  # tessera/models/quantized.py's LAYERS
SCHEDULING_POLICIES = ("fcfs", "shortest_first")  # the order of the waiting queue (scheduler.py)
KV_CACHE_DTYPES = ("int8", "dtype")  # how the paged KV cache stores keys and values (scheduling/kv_cache.py)


@dataclass
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap proposer guesses
    `num_tokens` tokens, the target model scores all of them in one forward pass."""

    # "draft": a small model with the same tokenizer; "prompt_lookup": n-grams; "mtp": the served
    # model's own multi-token-prediction module (model.mtp_depth > 0; tessera/infer/runner/mtp_proposer.py);
    # "eagle": an EAGLE-3 draft head fed with the target's hidden states (tessera/infer/runner/eagle_proposer.py).
    # The option's default is None: no speculative decoding, no SpeculativeConfig.
    method: str = field(default="prompt_lookup", metadata=flag(
        "speculative decoding method (None: off; mtp: the model's own multi-token-prediction module drafts, for "
        "a model trained with model.mtp_depth > 0; eagle: an EAGLE-3 draft head given by --draft-model drafts "
        "from the model's hidden states)", name="--speculative", choices=SPECULATIVE_METHODS, default=None))
    # k: tokens proposed per step (the target then scores k + 1 positions)
    num_tokens: int = field(default=4, metadata=flag("tokens proposed per speculative step",
                                                     name="--num-speculative-tokens", type=int))
    draft_model: str | None = field(default=None, metadata=flag(
        "draft model directory (with --speculative draft), or EAGLE-3 draft directory (with --speculative eagle: "
        "what tessera train with train.eagle.target writes)"))
    ngram_max: int = 3  # prompt lookup: the longest suffix n-gram searched for in the context
    ngram_min: int = 1  # ... and the shortest one tried before giving up

    def __post_init__(self) -> None:
        require(self.method in SPECULATIVE_METHODS, "speculative.method", self.method,
                f"one of {', '.join(SPECULATIVE_METHODS)}")
        require(1 <= self.num_tokens <= 16, "speculative.num_tokens", self.num_tokens, "must be in 1..16")
        require(self.method not in ("draft", "eagle") or bool(self.draft_model), "speculative.draft_model",
                self.draft_model, f"method {self.method!r} needs the directory of a draft model (--draft-model DIR)")
        require(1 <= self.ngram_min <= self.ngram_max, "speculative.ngram_min", self.ngram_min,
                f"must be in 1..ngram_max={self.ngram_max}")


# Why two features are not served together, by the field that rules the other out: the GGUF blocks
# kept quantized (tessera/models/gguf_linear.py), and the ranks of tensor parallelism (tensor_parallel.py).
_RULED_OUT_BY = {
    "gguf_keep_quantized": ("the GGUF blocks are served as stored, without LoRA or another quantization",
                            "drop gguf_keep_quantized (by default a GGUF file is dequantized where they need it)"),
    "tensor_parallel_size": ("LoRA and quantized weights are served on one rank", "use tensor_parallel_size=1"),
}


@dataclass
class EngineConfig:
    """How the engine lays out its KV cache and batches requests."""

    dtype: str = field(default="float32", metadata=flag(  # float32 is the fast and exact choice on CPU
        "dtype of the weights and activations (fp32, bf16, fp16 as in train.dtype are accepted)",
        type=dtype_argument, choices=tuple(DTYPES)))
    # the option's default is auto (the GPU when there is one); the Python API's stays on the CPU
    device: str = field(default="cpu", metadata=flag(
        "auto (cuda when available, else cpu), cpu, cuda or cuda:N; as train.device", default="auto",
        to_field=lambda name: resolve_device(name, key="--device")))
    # the unit of allocation and of prefix reuse
    block_size: int = field(default=16, metadata=flag("tokens per KV-cache block", type=int))
    # None: from kv_cache_gib, capped at what max_num_seqs full sequences need
    num_blocks: int | None = field(default=None, metadata=flag(
        "KV-cache blocks (None: from --kv-cache-gib)", type=int_in(1, MAX_KV_BLOCKS)))
    kv_cache_gib: float = field(default=1.0, metadata=flag(
        "memory for the KV cache when --num-blocks is unset", type=positive_float(MAX_KV_CACHE_GIB)))
    # "int8": per-token, per-head absmax scales; "dtype": in `dtype`. None (the default) is settled as the
    # model loads (`kv_cache_dtype_for`): int8 for a GGUF file on the CPU, as compact as llama.cpp's cache
    kv_cache_dtype: str | None = field(default=None, metadata=flag(
        "store keys/values as int8 (one scale per token and head: a quarter of fp32's bytes) or in --dtype "
        "(dtype). None: int8 for a GGUF model served on the CPU (llama.cpp's server keeps f16 there), --dtype "
        "otherwise", choices=KV_CACHE_DTYPES))
    max_num_seqs: int = field(default=64, metadata=flag("sequences in flight at once", type=int))
    # prefill chunks + decodes
    max_num_batched_tokens: int = field(default=1024, metadata=flag("token budget of one engine step", type=int))
    max_model_len: int | None = field(default=None, metadata=flag(
        "prompt + completion limit (None: the model's max_seq_len)", type=int))
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "do not reuse KV blocks of shared prefixes", name="--no-prefix-caching", action="store_true",
        to_field=lambda off: not off))
    # scheduling/state_snapshots.py: a hybrid model's prefix caching keeps its recurrent state every this many
    # tokens; the default cuts prompts only where the recurrent layers' chunked form cuts them anyway
    state_snapshot_tokens: int | None = field(default=None, metadata=flag(
        "tokens between a hybrid model's recurrent-state snapshots for prefix caching, a multiple of "
        "--block-size (None: the linear-attention or Mamba-2 chunk size rounded up to whole blocks)", type=int))
    # scheduling/window_blocks.py: "bounded" gives the windowed layers a pool of their own, a ring per sequence
    # (a prefix's window blocks kept with it for prefix reuse); "kept" keeps every layer's blocks in one pool
    windowed_kv: str = field(default="bounded", metadata=flag(
        "KV blocks of sliding-window and chunked layers: bounded (a pool of their own, a ring of the "
        "window's slots per sequence, the blocks a cached prefix's end sees kept while room lasts) or kept "
        "(every block kept, prefix caching as for any model)", choices=("bounded", "kept")))
    scheduling_policy: str = field(default="fcfs", metadata=flag(  # the scheduler's waiting queue
        "order waiting requests are admitted in: arrival order (fcfs); or arrival order, and those arriving "
        "between the same two steps shortest prompt first (shortest_first)", choices=SCHEDULING_POLICIES))
    system_prompts: list[str] = field(default_factory=list, metadata=flag(  # their blocks pinned
        "prefill TEXT at start and keep its KV blocks cached (repeatable)", name="--system-prompt",
        action="append", metavar="TEXT", type=text, to_field=list))
    speculative: SpeculativeConfig | None = field(default=None, metadata=section(SpeculativeConfig, "method"))
    # weight-only, round-to-nearest (tessera/models/quantized.py)
    quantization: str | None = field(default=None, metadata=flag(
        "quantize the block layers' weights at load, round-to-nearest (None: as stored); activations stay in "
        "--dtype, except fp8 on a CUDA GPU with FP8 tensor cores, which casts them to e4m3 per tensor for the "
        "product: int8 = int8 per output channel; fp8 = float8 e4m3 per output channel; int4 = symmetric 4-bit, "
        "two per byte, one scale per group of 128 inputs (per row when 128 does not divide them). The embedding, "
        "router and output head stay in --dtype", choices=QUANTIZATION_METHODS))
    # In the file's block format (tessera/models/gguf_linear.py); False: dequantized at load; None (the
    # default): kept where nothing here rules it out (`gguf_blocks_kept`), so that a command that
    # served a GGUF file dequantized before keeps working with the options it gives.
    gguf_keep_quantized: bool | None = field(default=None, metadata=flag(
        "a GGUF model: keep its quantized attention/MLP matrices in memory as the file's blocks, multiplied in the "
        "block format in each forward (a gpt-oss MXFP4 directory: its experts kept packed); the embedding, norms "
        "and output head are dequantized at load. None: kept "
        "unless --quantization, --lora, --merge-lora, --tensor-parallel-size > 1 or --allow-runtime-lora need "
        "them dequantized; with this switch those options are refused instead, but for --tensor-parallel-size, "
        "under which each rank keeps its part of the blocks", action="store_true",
        opposite="--gguf-dequantize", opposite_help=(
            "a GGUF model: dequantize all its weights into --dtype at load (more memory; what those options need)")))
    # name -> PEFT directory, served per request
    lora_adapters: dict[str, str] = field(default_factory=dict, metadata=flag(
        "serve the PEFT adapter DIR under model name NAME (repeatable)", name="--lora", action="append",
        metavar="NAME=DIR", default=[], to_field=named_adapters))
    merge_lora: list[str] = field(default_factory=list, metadata=flag(
        "merge the PEFT adapter DIR into the weights at load (repeatable)", action="append", metavar="DIR",
        to_field=list))
    max_loras: int = field(default=8, metadata=flag("LoRA adapters held at once", type=int))
    seed: int = field(default=0, metadata=flag(  # of requests that do not give one
        "seed of the sampler (a request's `seed` overrides it)", type=seed))
    # Batch sizes of the static-shape decode step (a step's decodes are padded up to the next one);
    # None: 1, 2, 4, ... up to max_num_seqs; []: decodes run in the packed step with the prefills.
    decode_batch_sizes: list[int] | None = field(default=None, metadata=flag(
        "batch-size buckets of the static-shape decode step (None: 1,2,4,... up to --max-num-seqs; 'none': "
        "decode in the packed step)", type=batch_sizes, metavar="B1,B2,..."))
    enforce_eager: bool = field(default=False, metadata=flag(
        "run the decode step eagerly instead of replaying CUDA graphs (no effect on CPU)", action="store_true"))
    # a model loaded from a directory (infer/cpu/linear.py)
    cpu_prepack: bool = field(default=True, metadata=flag(
        "on CPU in float32, keep F.linear instead of the packed projections (the panel kernel, oneDNN where it does "
        "not apply) with the weights reordered once at load (which holds a second copy of those weights)",
        name="--no-cpu-prepack", action="store_false"))
    # attention's products and sums in float64 (paged_attention.py; GRPO's rollouts set it in fp32 runs)
    fp64_attention: bool = field(default=False, metadata=flag(
        "attend in float64, each output rounded back to --dtype: the log-probabilities of sampled tokens then agree "
        "with a training forward's over whole rows to about 1e-7 (fp32) whatever the batch, at the cost of "
        "slower attention (on CPU without the C++ kernel)", action="store_true"))
    # Ranks the model is split over (tensor_parallel.py). 1: one process, as without the option.
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "split the model over N ranks (attention heads, MLP and expert hidden dims, vocabulary): this process "
        "and N-1 workers it starts, gloo on CPU, NCCL on GPUs (rank r on cuda:B+r with --device cuda:B; N GPUs "
        "from there must exist); N must divide the heads, KV heads, vocabulary and FFN dims; N > 1 decodes "
        "without CUDA graphs and serves no LoRA or quantized weights. If a rank fails or exits (or a step fails "
        "on this one), requests in flight get the error, GET /health answers 503 naming the rank, and tessera "
        "serve exits with status 1 for its supervisor to restart it", type=int_in(1, 1024),
        metavar="N"))
    # KV tiers below the device (kv_tiers.py; prefix caching on, one rank)
    kv_offload_gib: float = field(default=0.0, metadata=flag(
        "host memory for prefix blocks the device evicts; a later hit copies them back (0: none)",
        type=nonnegative_float(MAX_KV_CACHE_GIB)))
    kv_cache_dir: str | None = field(default=None, metadata=flag(
        "private directory of prefix blocks, shared by servers of this model and kept across restarts "
        "(None: none)", metavar="DIR"))
    kv_cache_dir_gib: float = field(default=16.0, metadata=flag(
        "size bound of --kv-cache-dir; the least recently used files go past it",
        type=positive_float(MAX_KV_CACHE_GIB)))
    # prefill/decode disaggregation (kv_transfer.py)
    kv_role: str | None = field(default=None, metadata=flag(
        "prefill/decode disaggregation behind `tessera router`: 'prefill' hands out the KV blocks of the prompts "
        "it computes, 'decode' takes them into its host tier (needs --kv-offload-gib); both need the KV peer secret "
        "(--kv-peer-secret-file), and beyond loopback --api-key (None: neither)", choices=("prefill", "decode")))
    # Multimodal items per prompt, by modality (vLLM's --limit-mm-per-prompt): {"image": N} allows at
    # most N images in one request (0: none); a modality left out is bounded by the context length only.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict, metadata=flag(
        "items per prompt by modality: image=2, or JSON {\"image\": 2} (default: no count limit)",
        type=mm_limits, metavar="LIMITS", to_field=dict))
    mm_encoder_cache_images: int = 64  # a vision-language model's encoder outputs kept, by image content

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                      names: Iterable[str] | None = None) -> None:
        """Add the options of the fields in `names` (None: all that have one) to a command's parser."""
        add_flags(parser, cls, names)

    @classmethod
    def from_args(cls, args: argparse.Namespace, names: Iterable[str] | None = None, **fields: Any) -> EngineConfig:
        """The config the parsed options (those `add_arguments` added for `names`) and `fields` give."""
        return cls(**values_from_args(cls, args, names), **fields)

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        self.dtype = dtype_name(self.dtype)  # train.dtype's bf16 is bfloat16 (tessera.config.dtypes)
        self._check_cache()
        self._check_features()
        self._check_kv_tiers()
        self._check_media()
        self._check_speculative()

    def _check_cache(self) -> None:
        """The KV cache's geometry and the batching limits."""
        require(self.block_size > 0 and (self.block_size & (self.block_size - 1)) == 0, "block_size",
                self.block_size, "must be a positive power of two")
        require(self.num_blocks is None or self.num_blocks > 0, "num_blocks", self.num_blocks,
                "must be None or a positive integer")
        require(self.kv_cache_gib > 0, "kv_cache_gib", self.kv_cache_gib, "must be > 0")
        require(self.state_snapshot_tokens is None or (
            self.state_snapshot_tokens > 0 and self.state_snapshot_tokens % self.block_size == 0),
            "state_snapshot_tokens", self.state_snapshot_tokens,
            f"must be None or a positive multiple of block_size={self.block_size}")
        require(self.kv_cache_dtype in (None, *KV_CACHE_DTYPES), "kv_cache_dtype", self.kv_cache_dtype,
                "None, " + " or ".join(map(repr, KV_CACHE_DTYPES)))
        require(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "must be > 0")
        require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", self.max_num_batched_tokens,
                "must be > 0")
        require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
                "one of " + ", ".join(map(repr, SCHEDULING_POLICIES)))
        require(self.max_model_len is None or self.max_model_len > 1, "max_model_len", self.max_model_len,
                "must be None or > 1")
        if self.decode_batch_sizes is not None:
            self.decode_batch_sizes = sorted({int(b) for b in self.decode_batch_sizes})
            require(all(b > 0 for b in self.decode_batch_sizes), "decode_batch_sizes", self.decode_batch_sizes,
                    "must be positive batch sizes (or [] for no static-shape decode step)")

    def _check_features(self) -> None:
        """Quantization, LoRA, GGUF blocks and tensor parallelism, and which of them go together."""
        require(self.quantization in (None, *QUANTIZATION_METHODS), "quantization", self.quantization,
                "None or one of " + ", ".join(map(repr, QUANTIZATION_METHODS)))
        if self.gguf_keep_quantized:
            for key in ("quantization", "lora_adapters", "merge_lora"):
                self._refuse_with(key, "gguf_keep_quantized")
        require(self.max_loras > 0, "max_loras", self.max_loras, "must be > 0")
        require(len(self.lora_adapters) <= self.max_loras, "lora_adapters", sorted(self.lora_adapters),
                f"at most max_loras={self.max_loras} adapters")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        if self.tensor_parallel_size > 1:
            for key in ("lora_adapters", "merge_lora", "quantization"):
                self._refuse_with(key, "tensor_parallel_size")

    def gguf_blocks_kept(self, is_gguf: bool) -> bool:
        """Whether a model loads with its GGUF blocks kept (`is_gguf`: it is a GGUF file): as
        gguf_keep_quantized says, or by default for a GGUF file unless quantization, LoRA or
        tensor parallelism need its weights dequantized. True for a file that is not GGUF only when
        asked for (the loader refuses it)."""
        if self.gguf_keep_quantized is not None:
            return self.gguf_keep_quantized
        return is_gguf and not (self.quantization or self.lora_adapters or self.merge_lora
                                or self.tensor_parallel_size > 1)

    def kv_cache_dtype_for(self, is_gguf: bool) -> str:
        """How a model's KV cache is stored (`is_gguf`: it is a GGUF file): as kv_cache_dtype says, or by
        default int8 for a GGUF file served on the CPU (a quantized model whose user compares it with
        llama.cpp's server, whose cache is f16 there) and in `dtype` for any other."""
        if self.kv_cache_dtype is not None:
            return self.kv_cache_dtype
        return "int8" if is_gguf and self.device == "cpu" else "dtype"

    def _refuse_with(self, key: str, ruler: str) -> None:
        """Refuse `key` set while `ruler` (a key of _RULED_OUT_BY) is, naming both as fields and as options."""
        value, ruling = getattr(self, key), getattr(self, ruler)
        why, fix = _RULED_OUT_BY[ruler]
        require(not value, key, value, f"not supported with {ruler}={ruling!r} ({flag_text(EngineConfig, key, value)} "
                f"is not supported with {flag_text(EngineConfig, ruler, ruling)}: {why}); {fix}")

    def check_runtime_lora(self) -> None:
        """Refuse loading LoRA adapters while serving (`LLMEngine.load_lora`; `tessera serve
        --allow-runtime-lora` refuses to start) where adapters cannot be served, by the same rule
        as lora_adapters and merge_lora."""
        for ruler, on in (("tensor_parallel_size", self.tensor_parallel_size > 1),
                          ("gguf_keep_quantized", self.gguf_keep_quantized)):
            if on:
                ruling = getattr(self, ruler)
                why, fix = _RULED_OUT_BY[ruler]
                raise ConfigError(f"LoRA adapters are not supported with {ruler}={ruling!r} (--allow-runtime-lora "
                                  f"is not supported with {flag_text(EngineConfig, ruler, ruling)}: {why}); {fix}")

    def _check_kv_tiers(self) -> None:
        """The KV tiers' and the disaggregation role's fields (kv_tiers.py, kv_transfer.py)."""
        require(self.kv_offload_gib >= 0, "kv_offload_gib", self.kv_offload_gib, "must be >= 0 (0: no host tier)")
        require(self.kv_cache_dir_gib > 0, "kv_cache_dir_gib", self.kv_cache_dir_gib, "must be > 0")
        if self.has_kv_tiers:
            key, value = ("kv_offload_gib", self.kv_offload_gib) if self.kv_offload_gib else ("kv_cache_dir",
                                                                                             self.kv_cache_dir)
            require(self.enable_prefix_caching, key, value, "needs prefix caching (blocks are found by their prefix "
                    "hash); do not disable it")
            require(self.tensor_parallel_size == 1, key, value, "is served on one rank; use tensor_parallel_size=1")
        require(self.kv_role in (None, "prefill", "decode"), "kv_role", self.kv_role, "None, 'prefill' or 'decode'")
        if self.kv_role is not None:
            require(self.enable_prefix_caching and self.tensor_parallel_size == 1, "kv_role", self.kv_role,
                    "needs prefix caching on and tensor_parallel_size=1")
            require(self.kv_role != "decode" or self.kv_offload_gib > 0, "kv_role", self.kv_role,
                    "'decode' receives blocks into the host tier: give kv_offload_gib > 0")

    def _check_media(self) -> None:
        require(isinstance(self.limit_mm_per_prompt, dict) and set(self.limit_mm_per_prompt) <= set(MODALITIES)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in self.limit_mm_per_prompt.values()),
                "limit_mm_per_prompt", self.limit_mm_per_prompt,
                f"a mapping from modality ({', '.join(MODALITIES)}) to a count >= 0, e.g. {{'image': 2}}")
        require(self.mm_encoder_cache_images >= 1, "mm_encoder_cache_images", self.mm_encoder_cache_images,
                "must be >= 1")

    def check_media_count(self, modality: str, count: int) -> None:
        """Refuse a request carrying more items of `modality` than limit_mm_per_prompt allows
        (RequestError naming its images; the server counts a chat's before fetching any)."""
        limit = self.limit_mm_per_prompt.get(modality)
        if limit is not None and count > limit:
            raise RequestError(f"the request has {count} {modality}s; at most {limit} per prompt are allowed "
                               "(limit_mm_per_prompt, --limit-mm-per-prompt)", field="images")

    def _check_speculative(self) -> None:
        spec = self.speculative
        if spec is not None and spec.method in ("mtp", "eagle"):
            # the MTP and EAGLE drafts read the target's hidden states from the packed step on this process
            require(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
                    f"speculative.method={spec.method!r} drafts on one process; use tensor_parallel_size=1")
            require(not self.decode_batch_sizes, "decode_batch_sizes", self.decode_batch_sizes,
                    f"speculative.method={spec.method!r} decodes in the packed step (it reads its hidden states); "
                    "use []")
            self.decode_batch_sizes = []
        if spec is not None:
            require(self.max_num_batched_tokens >= spec.num_tokens + 1, "max_num_batched_tokens",
                    self.max_num_batched_tokens, f"must be >= speculative.num_tokens + 1 = {spec.num_tokens + 1}")

    def check_vision_language(self, family: str) -> None:
        """Refuse, naming each, the features not served for a vision-language model (images need
        one rank, and a forward that takes their feature rows)."""
        refused = {"tensor_parallel_size": self.tensor_parallel_size > 1, "lora_adapters": bool(self.lora_adapters),
                   "merge_lora": bool(self.merge_lora), "quantization": self.quantization is not None,
                   "speculative": self.speculative is not None, "kv_role": self.kv_role is not None}
        for key, on in refused.items():
            require(not on, key, getattr(self, key), f"not supported for the vision-language model family "
                    f"{family!r} (served on one rank, without LoRA, quantization, speculative decoding or "
                    "disaggregation)")

    @property
    def has_kv_tiers(self) -> bool:
        return bool(self.kv_offload_gib) or self.kv_cache_dir is not None

    @property
    def lookahead(self) -> int:
        """Extra KV slots a decoding sequence reserves per step for speculative tokens."""
        return 0 if self.speculative is None else self.speculative.num_tokens

    @property
    def torch_dtype(self):
        """`dtype` as a torch dtype (torch is imported there, not with this module: `tessera serve
        --help` reads this file without torch)."""
        return torch_dtype(self.dtype)

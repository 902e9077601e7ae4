"""Serving engine configuration: cache geometry, batching limits, and the optional features
(prefix reuse, speculative decoding, LoRA, weight quantization), one documented field at a time.

Every field is validated in `__post_init__`; a bad value raises `ConfigError` naming the key,
the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config.errors import require

DTYPES = ("float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("draft", "prompt_lookup", "mtp", "eagle")
QUANTIZATION_METHODS = ("int8", "fp8", "int4")  # tessera/models/quantized.py's LAYERS
SCHEDULING_POLICIES = ("fcfs", "shortest_first")  # the order of the waiting queue (scheduler.py)
MODALITIES = ("image",)  # what a request may carry besides text


@dataclass
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap proposer guesses
    `num_tokens` tokens, the target model scores all of them in one forward pass."""

    # "draft": a small model with the same tokenizer; "prompt_lookup": n-grams; "mtp": the served
    # model's own multi-token-prediction module (model.mtp_depth > 0; tessera/infer/mtp_proposer.py);
    # "eagle": an EAGLE-3 draft head fed with the target's hidden states (tessera/infer/eagle_proposer.py)
    method: str = "prompt_lookup"
    num_tokens: int = 4  # k: tokens proposed per step (the target then scores k + 1 positions)
    # HuggingFace directory of the draft model (method "draft"), or the EAGLE-3 draft directory (method "eagle")
    draft_model: str | None = None
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


@dataclass
class EngineConfig:
    """How the engine lays out its KV cache and batches requests."""

    dtype: str = "float32"  # weights and activations; float32 is the fast and exact choice on CPU
    device: str = "cpu"
    block_size: int = 16  # tokens per KV-cache block (the unit of allocation and of prefix reuse)
    num_blocks: int | None = None  # None: from kv_cache_gib, capped at what max_num_seqs full sequences need
    kv_cache_gib: float = 1.0  # memory for the KV cache when num_blocks is None
    kv_cache_dtype: str | None = None  # None: the model dtype; "int8": per-token, per-head absmax scales
    max_num_seqs: int = 64  # sequences in flight at once
    max_num_batched_tokens: int = 1024  # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + completion limit; None: the model's max_seq_len
    enable_prefix_caching: bool = True  # reuse the KV blocks of identical prompt prefixes
    # The order waiting requests are admitted in (scheduler.py): "fcfs": arrival order; "shortest_first":
    # arrival order, and the requests that arrived between the same two steps shortest prompt first
    scheduling_policy: str = "fcfs"
    system_prompts: list[str] = field(default_factory=list)  # prefilled at start, their blocks pinned
    speculative: SpeculativeConfig | None = None
    # None, or weights quantized at load (weight-only, round-to-nearest; tessera/models/quantized.py):
    # "int8" (per output channel), "fp8" (e4m3, per output channel), "int4" (packed, per group of 128 inputs)
    quantization: str | None = None
    # A GGUF model's quantized attention/MLP matrices kept in memory in the file's block format
    # (tessera/models/gguf_linear.py), dequantized inside each forward; False: dequantized at load
    gguf_keep_quantized: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT directory, served per request
    merge_lora: list[str] = field(default_factory=list)  # PEFT directories merged into the weights at load
    max_loras: int = 8  # dynamic adapters resident at once
    seed: int = 0  # seed of requests that do not give one
    # Batch sizes of the static-shape decode step (a step's decodes are padded up to the next one);
    # None: 1, 2, 4, ... up to max_num_seqs; []: decodes run in the packed step with the prefills.
    decode_batch_sizes: list[int] | None = None
    enforce_eager: bool = False  # never capture the decode step in CUDA graphs (no effect on CPU)
    # on CPU in fp32, a model loaded from a directory multiplies by its projection weights reordered
    # once for oneDNN (cpu_linear.py): faster, at the cost of a second copy of those weights
    cpu_prepack: bool = True
    # Ranks the model is split over (tensor parallelism: heads, MLP / expert hidden dims and the
    # vocabulary; tensor_parallel.py). 1: one process, as without the option. N > 1 starts N - 1
    # worker processes (gloo on CPU, NCCL on GPUs, rank r on cuda:r) and decodes without CUDA graphs.
    tensor_parallel_size: int = 1
    # KV tiers below the device (kv_tiers.py; prefix caching on, one rank): host memory for blocks the
    # device evicts (0: none), and a private directory shared by servers and restarts (None: none)
    kv_offload_gib: float = 0.0
    kv_cache_dir: str | None = None
    kv_cache_dir_gib: float = 16.0  # the directory's bound: past it the least recently used files go
    # prefill/decode disaggregation (kv_transfer.py): None, "prefill" (hands out the KV blocks of the
    # prompts it computes) or "decode" (takes them into its host tier: needs kv_offload_gib)
    kv_role: str | None = None
    # Multimodal items per prompt, by modality (vLLM's --limit-mm-per-prompt): {"image": N} allows at
    # most N images in one request (0: none); a modality left out is bounded by the context length only.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_encoder_cache_images: int = 64  # a vision-language model's encoder outputs kept, by image content

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        require(self.block_size > 0 and (self.block_size & (self.block_size - 1)) == 0, "block_size",
                self.block_size, "must be a positive power of two")
        require(self.num_blocks is None or self.num_blocks > 0, "num_blocks", self.num_blocks,
                "must be None or a positive integer")
        require(self.kv_cache_gib > 0, "kv_cache_gib", self.kv_cache_gib, "must be > 0")
        require(self.kv_cache_dtype in (None, "int8"), "kv_cache_dtype", self.kv_cache_dtype, "None or 'int8'")
        require(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "must be > 0")
        require(self.max_num_batched_tokens > 0, "max_num_batched_tokens", self.max_num_batched_tokens,
                "must be > 0")
        require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
                "one of " + ", ".join(map(repr, SCHEDULING_POLICIES)))
        require(self.max_model_len is None or self.max_model_len > 1, "max_model_len", self.max_model_len,
                "must be None or > 1")
        require(self.quantization in (None, *QUANTIZATION_METHODS), "quantization", self.quantization,
                "None or one of " + ", ".join(map(repr, QUANTIZATION_METHODS)))
        if self.gguf_keep_quantized:
            for key, value in (("quantization", self.quantization), ("lora_adapters", self.lora_adapters),
                               ("merge_lora", self.merge_lora)):
                require(not value, key, value, "not supported with gguf_keep_quantized=True (the GGUF blocks are "
                        "served as stored, without LoRA or another quantization); serve without gguf_keep_quantized")
        require(self.max_loras > 0, "max_loras", self.max_loras, "must be > 0")
        require(len(self.lora_adapters) <= self.max_loras, "lora_adapters", sorted(self.lora_adapters),
                f"at most max_loras={self.max_loras} adapters")
        if self.decode_batch_sizes is not None:
            self.decode_batch_sizes = sorted({int(b) for b in self.decode_batch_sizes})
            require(all(b > 0 for b in self.decode_batch_sizes), "decode_batch_sizes", self.decode_batch_sizes,
                    "must be positive batch sizes (or [] for no static-shape decode step)")
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        if self.tensor_parallel_size > 1:
            for key, value in (("lora_adapters", self.lora_adapters), ("merge_lora", self.merge_lora),
                               ("quantization", self.quantization),
                               ("gguf_keep_quantized", self.gguf_keep_quantized)):
                require(not value, key, value, f"not supported with tensor_parallel_size={self.tensor_parallel_size} "
                        "(LoRA and quantized weights are served on one rank); use tensor_parallel_size=1")
        self._check_kv_tiers()
        require(isinstance(self.limit_mm_per_prompt, dict) and set(self.limit_mm_per_prompt) <= set(MODALITIES)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in self.limit_mm_per_prompt.values()),
                "limit_mm_per_prompt", self.limit_mm_per_prompt,
                f"a mapping from modality ({', '.join(MODALITIES)}) to a count >= 0, e.g. {{'image': 2}}")
        require(self.mm_encoder_cache_images >= 1, "mm_encoder_cache_images", self.mm_encoder_cache_images,
                "must be >= 1")
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

    def check_vision_language(self, family: str) -> None:
        """Refuse, naming each, the features not served for a vision-language model (images need
        one rank, and a forward that takes their feature rows)."""
        refused = {"tensor_parallel_size": self.tensor_parallel_size > 1, "lora_adapters": bool(self.lora_adapters),
                   "merge_lora": bool(self.merge_lora), "quantization": self.quantization is not None,
                   "speculative": self.speculative is not None, "kv_role": self.kv_role is not None}
        for key, on in refused.items():
            require(not on, key, getattr(self, key), f"not supported for the vision-language model family {family!r} "
                    "(served on one rank, without LoRA, quantization, speculative decoding or disaggregation)")

    @property
    def has_kv_tiers(self) -> bool:
        return bool(self.kv_offload_gib) or self.kv_cache_dir is not None

    @property
    def lookahead(self) -> int:
        """Extra KV slots a decoding sequence reserves per step for speculative tokens."""
        return 0 if self.speculative is None else self.speculative.num_tokens

    @property
    def torch_dtype(self):
        """`dtype` as a torch dtype (torch is imported here, not with the module: `tessera serve
        --help` reads this file without torch)."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

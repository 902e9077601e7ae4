"""`train.lora`: train low-rank adapters over a frozen base model (LoRA, Hu et al. 2021) instead of the
whole model, optionally over a base held quantized (QLoRA, Dettmers et al. 2023).

    tessera train configs/tiny-dense.yaml --set train.lora.rank=8 --set train.init_from=HF_DIR

Each targeted linear layer W (out x in) of the transformer blocks gets y = W x + s * B (A dropout(x)),
A: rank x in, B: out x rank, s = alpha / rank (alpha / sqrt(rank) with rslora, Kalajdzievski 2023),
A drawn as PEFT draws it and B zero, so the run starts from the base model's outputs
(tessera.models.lora). Everything else is frozen: no gradient, no optimizer state; `modules_to_save`
names whole modules that train beside the adapters (the embedding, the head). Targets are named as
HuggingFace and PEFT name them (`q_proj` .. `down_proj`, or `all-linear`), through the family registry
(tessera/config/families), so `tessera convert RUN OUT --lora-adapter` writes the PEFT directory
`peft.PeftModel.from_pretrained`, vLLM and `tessera serve --lora` load (tessera.checkpoint.hf.peft), and
`--merge-lora` a merged HuggingFace directory.

What is refused by name: a target the model has no linear layer of (the message lists those it has), a
rank of 0 or larger than a targeted layer, the routed experts of an MoE model (its adapters go on
attention), a quantized base under any layout but one process, EAGLE, DPO, GRPO and vision-language runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tessera.config.errors import require
from tessera.config.families import REGISTRY

ALL_LINEAR = "all-linear"  # PEFT's spelling: every linear layer of the blocks (the head is modules_to_save's)
QUANTIZED_BASES = ("int8", "int4")  # tessera.models.quantized's weight-only formats, round-to-nearest
SAVED_MODULES = {"embed_tokens": "tok_embeddings", "lm_head": "output"}  # HuggingFace name -> Tessera module
MAX_LORA_RANK = 4096  # the serving side's bound too (tessera.infer.runner.lora)
_BLOCK_LINEAR = re.compile(r"layers\.\d+\.(attention|feed_forward)\.(\w+)\.weight")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the linear layers of the blocks, the rest of the model frozen."""

    # The adapters' rank r; None = no adapters (the whole model trains). 1..min(in, out) of every
    # targeted layer.
    rank: int | None = None
    alpha: float | None = None  # the scale's numerator (s = alpha / rank); None = rank (s = 1)
    dropout: float = 0.0  # dropout on the adapters' input, in [0, 1): drawn per rank, so 0 where layouts must agree
    # HuggingFace module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; MLA's
    # q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj), or [all-linear]: every linear layer of the blocks
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    rslora: bool = False  # s = alpha / sqrt(rank) (rank-stabilised LoRA)
    # Whole modules trained beside the adapters and saved with them: embed_tokens, lm_head (an untied head)
    modules_to_save: list[str] = field(default_factory=list)
    # The frozen base held quantized (QLoRA): int8 (per output channel) or int4 (groups of 128 inputs),
    # round-to-nearest (tessera.models.quantized); the adapters stay in fp32 master weights. None = as trained.
    quantize_base: str | None = None

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scaling(self) -> float:
        """s of the module docstring."""
        alpha = float(self.alpha if self.alpha is not None else self.rank)
        return alpha / (self.rank ** 0.5 if self.rslora else self.rank)


def linear_layers(model_cfg: Any) -> tuple[dict[str, dict[str, str]], set[str]]:
    """The block linear layers adapters may wrap, by HuggingFace short name: {q_proj: {Tessera module:
    HuggingFace module}}, from the family's tensor names; and the short names of the routed
    experts' projections (an MoE model's, none elsewhere), which take no adapter. An FFN name the
    routed experts share is not offered even where a dense layer has it: PEFT would match the experts too.
    Nor is a fused HuggingFace projection (Phi-3's qkv_proj, gate_up_proj), whose one PEFT adapter spans
    several Tessera layers."""
    layers: dict[str, dict[str, str]] = {}
    experts: set[str] = set()
    family = REGISTRY[model_cfg.family]
    fused = family.fused_rows(model_cfg)
    for key, hf_keys in family.tensor_names(model_cfg).items():
        if key in fused:
            continue
        if ".moe." in key:
            experts.update(h.split(".")[-2] for h in hf_keys if ".experts." in h and ".shared" not in h)
            continue
        m = _BLOCK_LINEAR.fullmatch(key)
        if m is None or "norm" in m[2] or len(hf_keys) != 1:
            continue
        hf_module = hf_keys[0].removesuffix(".weight")
        layers.setdefault(hf_module.rsplit(".", 1)[1], {})[key.removesuffix(".weight")] = hf_module
    return {k: v for k, v in layers.items() if k not in experts}, experts


def lora_targets(model_cfg: Any, lora: LoRAConfig) -> dict[str, str]:
    """Tessera module name -> HuggingFace module name of every layer of the model `model_cfg` that
    `lora` adapts, in model order (ConfigError naming an unknown target and the names the model has)."""
    layers, experts = linear_layers(model_cfg)
    names = list(layers) if ALL_LINEAR in lora.target_modules else lora.target_modules
    out: dict[str, str] = {}
    for name in names:
        require(name not in experts, "train.lora.target_modules", lora.target_modules,
                f"{name!r} names the routed experts of this {model_cfg.family} model, which take no adapter "
                f"(adapters go on attention in MoE models); allowed: {', '.join(layers)} or {ALL_LINEAR}")
        require(name in layers, "train.lora.target_modules", lora.target_modules,
                f"{name!r} is no linear layer of this {model_cfg.family} model; allowed: "
                f"{', '.join(layers)} or {ALL_LINEAR}")
        out.update(layers[name])
    return dict(sorted(out.items(), key=lambda kv: _model_order(kv[0])))


def _model_order(module: str) -> tuple[int, str]:
    return int(module.split(".")[1]), module


def validate_lora(cfg: Any) -> None:
    """train.lora's values, its targets against the model, and what it trains under."""
    lora = cfg.train.lora
    if not lora.enabled:
        for key, value, default in (("quantize_base", lora.quantize_base, None),
                                    ("modules_to_save", lora.modules_to_save, [])):
            require(value == default, f"train.lora.{key}", value, "needs train.lora.rank (null = no adapters)")
        return
    require(1 <= lora.rank <= MAX_LORA_RANK, "train.lora.rank", lora.rank,
            f"must be in 1..{MAX_LORA_RANK} (and at most a targeted layer's smaller side); null = no adapters")
    require(lora.alpha is None or lora.alpha > 0, "train.lora.alpha", lora.alpha, "must be > 0 (null = the rank)")
    require(0.0 <= lora.dropout < 1.0, "train.lora.dropout", lora.dropout, "must be in [0, 1)")
    require(bool(lora.target_modules), "train.lora.target_modules", lora.target_modules,
            f"at least one HuggingFace module name, or [{ALL_LINEAR}]")
    require(lora.quantize_base is None or lora.quantize_base in QUANTIZED_BASES, "train.lora.quantize_base",
            lora.quantize_base, f"one of {', '.join(QUANTIZED_BASES)}, or null (the base as trained)")
    for name in lora.modules_to_save:
        require(name in SAVED_MODULES, "train.lora.modules_to_save", lora.modules_to_save,
                f"{name!r} is not a module that trains whole beside adapters; allowed: {', '.join(SAVED_MODULES)}")
    require(not ("lm_head" in lora.modules_to_save and cfg.model.tie_embeddings), "train.lora.modules_to_save",
            lora.modules_to_save, "lm_head is the embedding here (model.tie_embeddings=true): name embed_tokens")
    lora_targets(cfg.model, lora)
    _check_runs(cfg)


def _check_runs(cfg: Any) -> None:
    """The runs adapters do not train in."""
    t, lora, p = cfg.train, cfg.train.lora, cfg.parallel
    require(t.eagle.target is None, "train.eagle.target", t.eagle.target,
            "null with train.lora (an EAGLE run trains a draft head, not adapters)")
    require(t.objective == "lm", "train.objective", t.objective,
            "lm with train.lora (adapters are trained on the data's next tokens; DPO and GRPO train the whole model)")
    require(cfg.data.kind != "vision_sft", "data.kind", cfg.data.kind,
            "pretrain or sft with train.lora (adapters on vision-language models are not supported)")
    require(not t.eval_tasks, "train.eval_tasks", t.eval_tasks,
            "[] with train.lora (tasks serve the whole model; evaluate the adapter after the run: tessera "
            "eval BASE --merge-lora ADAPTER_DIR)")
    if lora.quantize_base is not None:
        for key in ("pp", "tp", "cp", "ep", "dp_replicate"):
            require(getattr(p, key) == 1, f"parallel.{key}", getattr(p, key),
                    f"1 with train.lora.quantize_base={lora.quantize_base!r} (a quantized base trains in one process)")
        require(p.dp_shard in (1, -1), "parallel.dp_shard", p.dp_shard,
                f"1 with train.lora.quantize_base={lora.quantize_base!r} (a quantized base trains in one process)")
        require(not t.fp8, "train.fp8", t.fp8, "false with train.lora.quantize_base (the base is not a linear "
                "layer FP8 can take)")

"""EAGLE-3 draft directories: the HuggingFace layout vLLM and SGLang load for `--speculative eagle3`
drafts, written by `tessera train` with `train.eagle.target` and read by `tessera serve --speculative
eagle --draft-model DIR` (tessera.models.eagle.EagleDraft).

config.json: `architectures` ["LlamaForCausalLMEagle3"] (or vLLM's "Eagle3LlamaForCausalLM"), the
LLaMA fields of the one draft layer (`hidden_size`, `intermediate_size`, `num_attention_heads`,
`num_key_value_heads`, `head_dim`, `rms_norm_eps`, `rope_theta`, `rope_scaling`,
`max_position_embeddings`), `vocab_size` (the target's), `draft_vocab_size`, `target_hidden_size`,
and `eagle_config.eagle_aux_hidden_state_layer_ids` (the target's block counts whose residual
stream is fused; absent: vLLM's default (2, L // 2, L - 3) of an L-layer target).

model.safetensors: `midlayer.` + the layer's LLaMA names (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,
down}_proj`, `input_layernorm` on the embedding, `hidden_norm` on the fused feature,
`post_attention_layernorm`), `fc.weight` [D, 3 D_t], `norm.weight`, `lm_head.weight` [V_draft, D],
with a smaller draft vocabulary `d2t` [V_draft] (draft token d is target token d + d2t[d]) and
`t2d` [V] (bool: which target tokens the draft has; not needed to serve), and optionally
`embed_tokens.weight` (a draft with its own embedding; without it the target's is used).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.model import ModelConfig
from tessera.models.eagle import EagleDraft, default_feature_layers, draft_layer_config

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHTS = "model.safetensors"
# Tessera's parameter name -> the file's
NAMES = {"attention.wq.weight": "midlayer.self_attn.q_proj.weight",
         "attention.wk.weight": "midlayer.self_attn.k_proj.weight",
         "attention.wv.weight": "midlayer.self_attn.v_proj.weight",
         "attention.wo.weight": "midlayer.self_attn.o_proj.weight",
         "feed_forward.w1.weight": "midlayer.mlp.gate_proj.weight",
         "feed_forward.w3.weight": "midlayer.mlp.up_proj.weight",
         "feed_forward.w2.weight": "midlayer.mlp.down_proj.weight",
         "embed_norm.weight": "midlayer.input_layernorm.weight",
         "hidden_norm.weight": "midlayer.hidden_norm.weight",
         "ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
         "fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
         "embed.weight": "embed_tokens.weight", "d2t": "d2t"}


def save_eagle_draft(draft: EagleDraft, out: str | Path) -> Path:
    """Write `draft` as an EAGLE-3 directory (module docstring); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    c = draft.cfg
    config = {"architectures": [ARCHITECTURES[0]], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": c.dim, "intermediate_size": c.ffn_dim, "num_attention_heads": c.n_heads,
              "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
              "max_position_embeddings": c.max_seq_len, "vocab_size": c.vocab_size,
              "draft_vocab_size": draft.draft_vocab_size, "target_hidden_size": draft.target_dim,
              "tie_word_embeddings": False, "torch_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft.feature_layers),
                               "use_aux_hidden_state": True}}
    state = {NAMES[k]: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()}
    if draft.d2t is not None:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft.draft_vocab_size) + draft.d2t.cpu()] = True
        state["t2d"] = t2d
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"speculative.draft_model={str(path)!r}: cannot read its config.json ({e}); an "
                              "EAGLE-3 draft directory is expected") from e
    arch = (config.get("architectures") or ["(none)"])[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"speculative.draft_model={str(path)!r} is a {arch} directory; --speculative eagle takes "
                          f"an EAGLE-3 draft ({' or '.join(ARCHITECTURES)})")
    if not (config.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ConfigError(f"speculative.draft_model={str(path)!r} does not fuse the target's hidden states "
                          "(eagle_config.use_aux_hidden_state=false): an EAGLE-1/2 draft, which Tessera does not serve")
    return config


def load_eagle_draft(path: str | Path, target: ModelConfig, dtype: torch.dtype,
                     device: torch.device | str) -> EagleDraft:
    """The draft of directory `path` for a target of shape `target`, checked against it, in eval mode."""
    path = Path(path)
    config = _read_config(path)
    key = f"speculative.draft_model={str(path)!r}"
    try:
        state = load_file(str(path / WEIGHTS))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{key}: cannot read {WEIGHTS}: {e}") from e
    target_dim = config.get("target_hidden_size") or config["hidden_size"]
    layers = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(layers) if layers else default_feature_layers_vllm(target.n_layers)
    own = "embed_tokens.weight" in state
    checks = [(config["vocab_size"] == target.vocab_size, f"vocab_size={config['vocab_size']} (the target has "
               f"{target.vocab_size}): a draft must use the target's tokenizer"),
              (target_dim == target.dim, f"target_hidden_size={target_dim} (the target's width is {target.dim})"),
              (all(0 <= j <= target.n_layers for j in layers), f"eagle_aux_hidden_state_layer_ids={list(layers)} "
               f"(the target has {target.n_layers} layers: 0..{target.n_layers})"),
              (own or config["hidden_size"] == target.dim, f"hidden_size={config['hidden_size']} without its own "
               f"embed_tokens (the target's embedding is {target.dim} wide)")]
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"{key} does not fit the served model: {what}")
    cfg = draft_layer_config(target)
    heads = config["num_attention_heads"]
    cfg = replace(cfg, dim=config["hidden_size"], n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
                  head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                  ffn_dim=config["intermediate_size"], norm_eps=config.get("rms_norm_eps", 1e-6),
                  rope_theta=config.get("rope_theta", 10000.0),
                  rope_scaling=config.get("rope_scaling"),
                  max_seq_len=config.get("max_position_embeddings", target.max_seq_len))
    draft = EagleDraft(cfg, layers, target_dim, config.get("draft_vocab_size") or target.vocab_size, own)
    _load_state(draft, state, key)
    return draft.to(device=device, dtype=dtype).eval()


def default_feature_layers_vllm(n_layers: int) -> tuple[int, ...]:
    """The block counts vLLM fuses for a draft that names none: (2, L // 2, L - 3), or Tessera's
    default for a target too shallow for them."""
    return (2, n_layers // 2, n_layers - 3) if n_layers >= 4 else default_feature_layers(n_layers)


def _load_state(draft: EagleDraft, state: dict[str, torch.Tensor], key: str) -> None:
    """The file's tensors into `draft` by NAMES; missing and unexpected ones and shape mismatches named."""
    want = {NAMES[k]: k for k in draft.state_dict()}
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want) - {"t2d"})
    if missing or unexpected:
        raise CheckpointError(f"{key}: {WEIGHTS} does not hold the draft's tensors: missing {missing}, "
                              f"unexpected {unexpected}")
    own = draft.state_dict()
    for name, mine in want.items():
        if tuple(state[name].shape) != tuple(own[mine].shape):
            raise CheckpointError(f"{key}: {name} has shape {tuple(state[name].shape)}, the config says "
                                  f"{tuple(own[mine].shape)}")
    draft.load_state_dict({mine: state[name].to(own[mine].dtype) for name, mine in want.items()})

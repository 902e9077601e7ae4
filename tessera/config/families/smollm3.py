"""SmolLM3 (SmolLM3ForCausalLM): LLaMA's decoder whose attention has no positional encoding in some
layers (NoPE): config.json's `no_rope_layers` holds 1 for a layer rotated by RoPE and 0 for one
that is not (every 4th by default, `no_rope_layer_interval`), Tessera's `model.nope_layers` the
indices of the zeros. Its optional sliding window (`use_sliding_window`, on the NoPE layers) is
refused: Tessera's windows apply to every layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tessera.config.errors import ConfigError
from tessera.config.families.base import Family


def nope_layers_from_hf(d: Mapping[str, Any]) -> list[int]:
    """The indices of the layers without RoPE: `no_rope_layers`' zeros, else every
    `no_rope_layer_interval`-th layer (transformers' default when the list is absent)."""
    n_layers, flags = d["num_hidden_layers"], d.get("no_rope_layers")
    if flags is None:
        interval = d.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"no_rope_layer_interval={interval!r} is invalid: must be an integer >= 1")
        return [i for i in range(n_layers) if (i + 1) % interval == 0]
    if not isinstance(flags, list) or len(flags) < n_layers or any(type(f) is not int or f not in (0, 1)
                                                                     for f in flags):
        raise ConfigError(f"no_rope_layers={flags!r} is invalid: must be a list of 0 (NoPE) or 1 (RoPE), one per "
                          f"layer ({n_layers})")
    return [i for i in range(n_layers) if flags[i] == 0]


# transformers' SmolLM3Config defaults its token ids to the published tokenizer's; an export with a
# tokenizer writes that tokenizer's own (tessera/checkpoint/hf/tokenizer.py)
_DEFAULT_TOKEN_IDS = {"bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004}


@dataclass(frozen=True)
class SmolLM3(Family):
    nope: ClassVar[bool] = True

    def config_to_hf(self, cfg) -> dict[str, Any]:
        """config.json; a vocabulary without the class's default token ids says it has none of them
        (transformers would otherwise build an embedding whose padding row it does not have)."""
        d = super().config_to_hf(cfg)
        d.update({k: None for k, v in _DEFAULT_TOKEN_IDS.items() if v >= cfg.vocab_size})
        return d

    def attention_from_hf(self, d: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().attention_from_hf(d)  # refuses use_sliding_window
        fields["nope_layers"] = nope_layers_from_hf(d)
        return fields

    def attention_to_hf(self, cfg, d: dict[str, Any]) -> None:
        super().attention_to_hf(cfg, d)
        d.update(no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
                 use_sliding_window=False, sliding_window=None)


FAMILY = SmolLM3(name="smollm3", architecture="SmolLM3ForCausalLM", int_fields=("no_rope_layer_interval",), presets={
    # HuggingFaceTB/SmolLM3-3B: every 4th layer without RoPE, tied embeddings
    "smollm3-3b": dict(vocab_size=128256, dim=2048, n_layers=36, n_heads=16, n_kv_heads=4, ffn_dim=11008,
                       norm_eps=1e-6, rope_theta=5e6, max_seq_len=65536, tie_embeddings=True,
                       nope_layers=[i for i in range(36) if (i + 1) % 4 == 0]),
})

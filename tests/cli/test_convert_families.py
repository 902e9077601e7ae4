"""`tessera convert` both ways for every family: a random transformers model's directory becomes a
Tessera checkpoint and back, and transformers reads the result with the same logits (fp32, 1e-4)
and the same config.json fields that shape the model (its per-layer lists included)."""

import json

import pytest
import torch

from tessera.checkpoint.loading import load_model
from tessera.cli import main
from tests.infer.tiny_models import save_tokenizer
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
# fields whose value decides the function, and each family's own per-layer ones
KEPT = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
OWN = {"smollm3": ("no_rope_layers",), "olmo3": ("layer_types", "sliding_window"), "qwen3_next": ("layer_types",),
       "phi3": ("sliding_window", "original_max_position_embeddings", "partial_rotary_factor"),
       "gemma3_text": ("layer_types", "sliding_window", "query_pre_attn_scalar")}
OWN["qwen3_5_text"] = OWN["qwen3_5_moe_text"] = ("layer_types",)
OWN["kimi_linear"] = ("layer_types", "mlp_layer_types")
OWN["seed_oss"] = ("attention_bias", "attention_out_bias", "head_dim")
OWN["exaone4"] = ("layer_types", "sliding_window")
OWN["nemotron_h"] = ("layers_block_type", "head_dim", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                     "conv_kernel", "chunk_size", "time_step_min", "use_conv_bias")
OWN["llama4_text"] = ("no_rope_layers", "layer_types", "moe_layers", "attention_chunk_size", "use_qk_norm")


@pytest.mark.parametrize("name", sorted(hf_configs()))
def test_convert_to_tessera_and_back_keeps_the_logits(name, tmp_path, capsys):
    cfg = hf_configs()[name]
    cfg.vocab_size = 128  # the character tokenizer's
    hf = random_hf_model(cfg, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    capsys.readouterr()
    ids = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(2))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(back(ids).logits, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(load_model(tmp_path / "ckpt").model(ids).logits, want, atol=1e-4, rtol=1e-4)
    before, after = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    kept = KEPT + OWN.get(before["model_type"], ())
    assert {k: after.get(k) for k in kept} == {k: before.get(k) for k in kept}

"""The EAGLE-3 draft head (tessera/models/eagle.py) and its directory (tessera/checkpoint/eagle_dir.py):
training-time test computes what the serving chain computes, the target's hidden states kept by
`keep_layers`, the draft vocabulary's placement, and the HuggingFace EAGLE-3 layout vLLM loads, read
back against a forward written from its tensors alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tessera.checkpoint.eagle_dir import load_eagle_draft, save_eagle_draft
from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.models.eagle import EagleDraft, default_feature_layers, draft_layer_config, unrolled_outputs
from tessera.models.model_input import ModelInput
from tessera.models.transformer import Transformer

TARGET = ModelConfig(vocab_size=48, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                     init_std=0.2)


def _draft(seed: int = 0, draft_vocab: int | None = None, **extra) -> EagleDraft:
    draft = EagleDraft(draft_layer_config(TARGET), (1, 2, 3), TARGET.dim, draft_vocab, **extra)
    draft.init_weights(seed)
    return draft.eval()


def test_default_feature_layers_are_low_middle_and_high():
    assert default_feature_layers(32) == (2, 16, 29)  # vLLM's and SGLang's (2, L // 2, L - 3)
    assert default_feature_layers(4) == (1, 2, 3)
    assert default_feature_layers(1) == (1, 1, 1)


def test_kept_layers_are_the_residual_stream_after_that_many_blocks():
    model = Transformer(TARGET, init_seed=1).eval()
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(0))
    outputs = []
    for block in model.layers.values():
        block.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    with torch.no_grad():
        out = model(ModelInput(tokens=ids, keep_layers=(0, 2, 4)))
    D = TARGET.dim
    torch.testing.assert_close(out.kept_hidden[..., :D], model.tok_embeddings(ids), rtol=0, atol=0)
    torch.testing.assert_close(out.kept_hidden[..., D:2 * D], outputs[1], rtol=0, atol=0)
    torch.testing.assert_close(out.kept_hidden[..., 2 * D:], out.last_hidden, rtol=0, atol=0)
    assert model(ids).kept_hidden is None


@pytest.mark.parametrize("steps", [1, 3])
def test_training_time_test_computes_what_the_serving_chain_computes(steps):
    """Step j at position i of the unrolled training forward equals the chain serving runs: the
    draft over positions 0..i-j with the target's fused features, then j positions each fed with
    the draft's own previous output, attending causally over all of them."""
    draft = _draft(seed=2)
    gen = torch.Generator().manual_seed(3)
    S = 10
    emb = torch.randn(1, S, TARGET.dim, generator=gen)
    features = torch.randn(1, S, 3 * TARGET.dim, generator=gen)
    with torch.no_grad():
        outs = unrolled_outputs(draft, emb, features, steps)
        g = draft.fuse(features)
        for j in range(steps):
            for i in range(j, S):
                hidden = g[:, :i - j + 1]
                for _ in range(j):  # one chain step: the last output joins as the next position's state
                    h = _plain_forward(draft, emb[:, :hidden.shape[1]], hidden)
                    hidden = torch.cat([hidden, h[:, -1:]], dim=1)
                want = _plain_forward(draft, emb[:, :i + 1], hidden)[:, -1]
                torch.testing.assert_close(outs[j][:, i], want, rtol=1e-5, atol=1e-5)


def _plain_forward(draft: EagleDraft, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The draft over one whole sequence with plain causal attention (no cache)."""
    S = emb.shape[1]
    cos, sin = draft.rope(torch.arange(S)[None], emb.dtype)
    return draft(emb, hidden, cos, sin)


def test_a_smaller_draft_vocabulary_is_placed_by_d2t():
    draft = _draft(draft_vocab=5)
    with torch.no_grad():
        draft.d2t.copy_(torch.tensor([0, 3, 3, 10, 40]))  # draft token d -> target token d + d2t[d]
        h = torch.randn(2, TARGET.dim)
        z, full = draft.draft_logits(h), draft.logits(h)
    assert full.shape == (2, 48)
    torch.testing.assert_close(full[:, [0, 4, 5, 13, 44]], z)
    assert torch.isinf(full[:, [1, 2, 3, 6, 47]]).all()


def test_the_directory_round_trips_with_its_vocabulary_map(tmp_path):
    draft = _draft(seed=4, draft_vocab=6)
    with torch.no_grad():
        draft.d2t.copy_(torch.tensor([1, 1, 2, 2, 5, 30]))
    save_eagle_draft(draft, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    back = load_eagle_draft(tmp_path / "d", TARGET, torch.float32, "cpu")
    for (name, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with pytest.raises(ConfigError, match="vocab_size=48 .the target has 64"):
        load_eagle_draft(tmp_path / "d", replace(TARGET, vocab_size=64), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="target_hidden_size=32"):
        load_eagle_draft(tmp_path / "d", replace(TARGET, dim=64, head_dim=None), torch.float32, "cpu")


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [B, H, S, d] (HuggingFace's LLaMA convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def _reference(t: dict[str, torch.Tensor], cfg: dict, emb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Logits of an EAGLE-3 file's draft layer, written from the file's tensors as vLLM's layer
    computes them: [input_layernorm(emb) ; hidden_norm(g)] -> attention, + g, post-attention norm,
    SwiGLU MLP, + residual, final norm, lm_head."""
    eps, H, G = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    x = torch.cat([norm(emb, t["midlayer.input_layernorm.weight"]), norm(g, t["midlayer.hidden_norm.weight"])], -1)
    S, hd = x.shape[0], cfg["head_dim"]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(S, H, hd).transpose(0, 1)[None]
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(S, G, hd).transpose(0, 1)[None]
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(S, G, hd).transpose(0, 1)[None]
    pos = torch.arange(S)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(S, H * hd)
    h = g + a @ t["midlayer.self_attn.o_proj.weight"].T
    f = norm(h, t["midlayer.post_attention_layernorm.weight"])
    mlp = (F.silu(f @ t["midlayer.mlp.gate_proj.weight"].T) * (f @ t["midlayer.mlp.up_proj.weight"].T))
    h = h + mlp @ t["midlayer.mlp.down_proj.weight"].T
    return norm(h, t["norm.weight"]) @ t["lm_head.weight"].T


def test_a_vllm_eagle3_directory_loads_and_computes_its_layer(tmp_path):
    """A directory in the layout vLLM's Eagle3LlamaForCausalLM reads (midlayer.*, fc, norm, lm_head,
    d2t / t2d, no feature layer ids: vLLM's default (2, L // 2, L - 3)), written tensor by tensor
    here, gives the logits of the reference forward over the same tensors."""
    D, Dt, V, Vd, hd = 32, 32, 48, 8, 8
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    t = {"midlayer.self_attn.q_proj.weight": rand(4 * hd, 2 * D),
         "midlayer.self_attn.k_proj.weight": rand(2 * hd, 2 * D),
         "midlayer.self_attn.v_proj.weight": rand(2 * hd, 2 * D), "midlayer.self_attn.o_proj.weight": rand(D, 4 * hd),
         "midlayer.mlp.gate_proj.weight": rand(64, D), "midlayer.mlp.up_proj.weight": rand(64, D),
         "midlayer.mlp.down_proj.weight": rand(D, 64), "midlayer.input_layernorm.weight": 1 + rand(D),
         "midlayer.hidden_norm.weight": 1 + rand(D), "midlayer.post_attention_layernorm.weight": 1 + rand(D),
         "fc.weight": rand(D, 3 * Dt), "norm.weight": 1 + rand(D), "lm_head.weight": rand(Vd, D),
         "d2t": torch.tensor([0, 1, 1, 5, 5, 5, 20, 39]), "t2d": torch.zeros(V, dtype=torch.bool)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": D, "intermediate_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hd, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64, "vocab_size": V,
           "draft_vocab_size": Vd, "target_hidden_size": Dt, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(tmp_path / "model.safetensors"))
    target = replace(TARGET, n_layers=8)
    draft = load_eagle_draft(tmp_path, target, torch.float32, "cpu")
    assert draft.feature_layers == (2, 4, 5)
    emb, features = rand(6, D), rand(6, 3 * Dt)
    with torch.no_grad():
        g = features @ t["fc.weight"].T
        got = draft.logits(_plain_forward(draft, emb[None], draft.fuse(features)[None]))[0]
        want = _reference(t, cfg, emb, g)
    placed = torch.arange(Vd) + t["d2t"]
    torch.testing.assert_close(got[:, placed], want, rtol=1e-4, atol=1e-5)
    assert torch.isinf(got[:, [1, 4, 5, 7]]).all()  # target tokens the draft vocabulary lacks


def test_a_directory_that_is_not_an_eagle3_draft_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="LlamaForCausalLM directory; --speculative eagle takes an EAGLE-3 draft"):
        load_eagle_draft(tmp_path, TARGET, torch.float32, "cpu")


@pytest.mark.parametrize("preset", ["smollm3-3b", "olmo2-7b", "olmo3-7b"])
def test_the_draft_layer_of_any_family_is_llama_attention(preset):
    """NoPE layers, norms after the sublayers, an all-heads QK norm and per-layer windows are the
    target's: the draft layer keeps its width, heads and RoPE and drops the rest."""
    from tessera.config import get_preset

    target = get_preset(preset)
    cfg = draft_layer_config(target)
    assert (cfg.family, cfg.dim, cfg.n_heads, cfg.rope_theta, cfg.rope_scaling) == (
        "llama", target.dim, target.n_heads, target.rope_theta, target.rope_scaling)
    assert (cfg.nope_layers, cfg.block_norms, cfg.qk_norm, cfg.sliding_window, cfg.window_layers) == (
        [], "pre", False, None, None)

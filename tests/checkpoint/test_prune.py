"""`tessera prune`: HuggingFace in, HuggingFace out, with transformers as the oracle.

Pruning nothing keeps the function bit for bit; pruning keeps exactly the source's rows and columns
at the chosen indices (read from both directories' safetensors by HuggingFace name); the chosen
indices are the most important by the documented measures, which constructed models confirm (an
identity layer, silent FFN channels, a silent KV group) and which transformers' own router logits
confirm for experts; the output loads in transformers and in Tessera; a parameter target is met;
bad requests exit 2 naming the option, and a weight that is NaN or infinite naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint.calibration import calibration_sequences
from tessera.checkpoint.hf.load import load_pretrained
from tessera.cli import main
from tessera.data.tokenizer import load_tokenizer
from tessera.prune import PruneSizes, prune
from tests.infer.tiny_models import hf_config, save_tokenizer, write_model
from tests.models.hf_families import hf_configs, random_hf_model
from tests.quantize.damaged_sources import with_nonfinite_weight

CALIBRATION = dict(num_sequences=4, seq_len=48)
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(200))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """4 layers, 4 query heads in 2 KV groups, FFN 48, the character tokenizer (vocabulary 128)."""
    path = tmp_path_factory.mktemp("llama") / "hf"
    write_model(path, "llama", num_hidden_layers=4)
    return path


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory) -> Path:
    """3 layers (layer 1 dense, 0 and 2 with 6 routed experts, top-2, and a gated shared expert)."""
    path = tmp_path_factory.mktemp("qwen2_moe") / "hf"
    cfg = hf_configs()["qwen2_moe"]
    cfg.vocab_size = 128
    random_hf_model(cfg, seed=1).save_pretrained(path)
    save_tokenizer(path)
    return path


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _tokens() -> torch.Tensor:
    return torch.tensor([[(7 * i + 3) % 125 + 3 for i in range(24)], [(11 * i + 5) % 125 + 3 for i in range(24)]])


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_pruning_nothing_keeps_the_function_exactly(family, request, tmp_path, calibration):
    src = request.getfixturevalue(family)
    result = prune(src, tmp_path / "dst", PruneSizes(), calibration=[calibration], **CALIBRATION)
    assert result.params == result.source_params
    with torch.no_grad():
        assert torch.equal(_hf(src)(_tokens()).logits, _hf(tmp_path / "dst")(_tokens()).logits)
    before, after = _weights(src), _weights(tmp_path / "dst")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "dst" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def _head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()


def _top(scores: torch.Tensor, k: int) -> list[int]:
    """The k highest scores' indices, ascending (ties: the earlier), computed here from the scores."""
    ranked = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return sorted(ranked[:k])


def test_pruning_keeps_exactly_the_chosen_rows_and_columns(llama, tmp_path, calibration):
    r = prune(llama, tmp_path / "dst", PruneSizes(layers=3, ffn_dim=32, n_kv_heads=1), calibration=[calibration],
              **CALIBRATION)
    found, chosen = r.importance, r.selection
    assert r.sizes == PruneSizes(layers=3, ffn_dim=32, n_heads=2, n_kv_heads=1, num_experts=None,
                                 dim=r.source_sizes.dim)
    assert chosen.layers == _top(torch.tensor([found.layers[i] for i in range(4)]), 3)
    src, dst = _weights(llama), _weights(tmp_path / "dst")
    assert len(dst) == 3 + 3 * 9  # embeddings, final norm, head; 9 tensors per layer
    for new, old in enumerate(chosen.layers):
        ffn, heads = chosen.ffn_channels[old], chosen.q_heads[old]
        groups = found.heads[old].view(2, 2).sum(dim=1)
        assert chosen.kv_heads[old].tolist() == _top(groups, 1)
        g = int(chosen.kv_heads[old])
        assert heads.tolist() == [2 * g, 2 * g + 1]  # both query heads of the kept group, in order
        assert ffn.tolist() == _top(found.ffn_channels[old], 32)
        q, kv = _head_rows(heads, 8), _head_rows(chosen.kv_heads[old], 8)
        s, d = f"model.layers.{old}.", f"model.layers.{new}."
        expected = {"self_attn.q_proj.weight": src[s + "self_attn.q_proj.weight"][q],
                    "self_attn.k_proj.weight": src[s + "self_attn.k_proj.weight"][kv],
                    "self_attn.v_proj.weight": src[s + "self_attn.v_proj.weight"][kv],
                    "self_attn.o_proj.weight": src[s + "self_attn.o_proj.weight"][:, q],
                    "mlp.gate_proj.weight": src[s + "mlp.gate_proj.weight"][ffn],
                    "mlp.up_proj.weight": src[s + "mlp.up_proj.weight"][ffn],
                    "mlp.down_proj.weight": src[s + "mlp.down_proj.weight"][:, ffn],
                    "input_layernorm.weight": src[s + "input_layernorm.weight"],
                    "post_attention_layernorm.weight": src[s + "post_attention_layernorm.weight"]}
        for name, want in expected.items():
            assert torch.equal(dst[d + name], want), name
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(dst[name], src[name])
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    source = json.loads((llama / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["head_dim"]) == (3, 2, 1, 32, 8)
    assert {k: v for k, v in config.items() if k not in ("num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "head_dim", "layer_types")} == \
        {k: v for k, v in source.items() if k not in ("num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "intermediate_size", "head_dim", "layer_types")}


def test_pruned_model_loads_in_transformers_and_in_tessera(llama, tmp_path, capsys):
    """Calibrated on the bundled corpus (no --calibration); `tessera generate` and `convert` take the result."""
    assert main(["prune", str(llama), str(tmp_path / "dst"), "--layers", "2", "--ffn-hidden-size", "40",
                 "--num-heads", "2", "--calibration-sequences", "2", "--calibration-length", "32"]) == 0
    out = capsys.readouterr().out
    assert "layers 4 -> 2" in out and "heads 4 -> 2, KV groups 2 -> 2" in out and "ffn hidden size 48 -> 40" in out
    hf = _hf(tmp_path / "dst")
    assert (hf.config.num_hidden_layers, hf.config.num_attention_heads, hf.config.num_key_value_heads,
            hf.config.intermediate_size) == (2, 2, 2, 40)
    ours = load_pretrained(tmp_path / "dst")
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()).logits, hf(_tokens()).logits, rtol=1e-5, atol=1e-5)
    assert main(["generate", str(tmp_path / "dst"), "--prompt", "def f(x):", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["convert", str(tmp_path / "dst"), str(tmp_path / "tessera")]) == 0


def test_experts_kept_are_the_most_routed_by_transformers_router(qwen2_moe, tmp_path, calibration):
    r = prune(qwen2_moe, tmp_path / "dst", PruneSizes(num_experts=4), calibration=[calibration], **CALIBRATION)
    tokens = calibration_sequences([TEXT], load_tokenizer(qwen2_moe), CALIBRATION["num_sequences"],
                                   CALIBRATION["seq_len"])
    with torch.no_grad():
        router = _hf(qwen2_moe)(tokens, output_router_logits=True).router_logits  # the sparse layers 0 and 2
    src, dst = _weights(qwen2_moe), _weights(tmp_path / "dst")
    for layer, logits in zip((0, 2), router, strict=True):
        counts = torch.bincount(logits.topk(2, dim=-1).indices.flatten(), minlength=6)
        kept = _top(counts, 4)
        assert r.selection.experts[layer].tolist() == kept
        prefix = f"model.layers.{layer}.mlp."
        assert torch.equal(dst[prefix + "gate.weight"], src[prefix + "gate.weight"][kept])
        for new, old in enumerate(kept):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"experts.{{}}.{proj}.weight"
                assert torch.equal(dst[prefix + key.format(new)], src[prefix + key.format(old)])
        assert prefix + "experts.4.up_proj.weight" not in dst
        assert torch.equal(dst[prefix + "shared_expert_gate.weight"], src[prefix + "shared_expert_gate.weight"])
    hf = _hf(tmp_path / "dst")
    assert (hf.config.num_experts, hf.config.mlp_only_layers) == (4, [1])
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path / "dst")(_tokens()).logits, hf(_tokens()).logits,
                                   rtol=1e-5, atol=1e-5)


def test_dropping_a_layer_renumbers_the_dense_layers(qwen2_moe, tmp_path, calibration):
    r = prune(qwen2_moe, tmp_path / "dst", PruneSizes(layers=2, num_experts=3), calibration=[calibration],
              **CALIBRATION)
    hf = _hf(tmp_path / "dst")
    dense = [new for new, old in enumerate(r.selection.layers) if old == 1]
    assert hf.config.num_hidden_layers == 2 and hf.config.mlp_only_layers == dense
    assert sum(p.numel() for p in hf.parameters()) == r.params
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path / "dst")(_tokens()).logits, hf(_tokens()).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, fraction", [("llama", 0.7), ("llama", 0.3), ("qwen2_moe", 0.6)])
def test_target_params_gives_at_most_that_many(family, fraction, request, tmp_path, calibration):
    src = request.getfixturevalue(family)
    source = sum(p.numel() for p in _hf(src).parameters())
    target = int(source * fraction)
    r = prune(src, tmp_path / "dst", PruneSizes(), target_params=target, calibration=[calibration], **CALIBRATION)
    actual = sum(p.numel() for p in _hf(tmp_path / "dst").parameters())
    assert r.source_params == source and actual == r.params <= target


def _constructed(path: Path) -> None:
    """The llama fixture's model with layer 2 made an identity (o_proj and down_proj zero), FFN channels
    5 and 7 silent in every layer (their up_proj rows zero) and KV group 1 silent (its v_proj rows zero)."""
    model = random_hf_model(hf_config("llama", num_hidden_layers=4), seed=3)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.mlp.up_proj.weight[[5, 7]] = 0
            layer.self_attn.v_proj.weight[8:16] = 0
            if i == 2:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    save_tokenizer(path)


def test_dropping_layers_keeps_the_kept_layers_without_rope_so(tmp_path, calibration):
    """SmolLM3 with layers 1 and 3 of 4 without RoPE, layer 2 contributing nothing: the pruned model
    has 3 layers, its layers 1 and 2 (the old 1 and 3) without RoPE, and transformers agrees."""
    model = random_hf_model(hf_config("smollm3", num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0]), seed=3)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    model.save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    r = prune(tmp_path / "src", tmp_path / "dst", PruneSizes(layers=3), calibration=[calibration], **CALIBRATION)
    assert r.selection.layers == [0, 1, 3]
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["no_rope_layers"] == [1, 0, 0]
    with torch.no_grad():
        want = model(_tokens()).logits
        torch.testing.assert_close(_hf(tmp_path / "dst")(_tokens()).logits, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(load_pretrained(tmp_path / "dst")(_tokens()).logits, want, rtol=1e-4, atol=1e-5)


def test_importance_drops_what_contributes_nothing_first(tmp_path, calibration):
    _constructed(tmp_path / "src")
    r = prune(tmp_path / "src", tmp_path / "dst", PruneSizes(layers=3, ffn_dim=46, n_kv_heads=1),
              calibration=[calibration], **CALIBRATION)
    assert r.importance.layers[2] == pytest.approx(0.0, abs=1e-6)
    assert min(r.importance.layers[i] for i in (0, 1, 3)) > 1e-3
    assert r.selection.layers == [0, 1, 3]
    for old in r.selection.layers:
        assert sorted(set(range(48)) - set(r.selection.ffn_channels[old].tolist())) == [5, 7]
        assert r.selection.kv_heads[old].tolist() == [0] and r.selection.q_heads[old].tolist() == [0, 1]


@pytest.mark.parametrize("argv, named", [
    (["--num-heads", "3"], "--num-heads 3 is invalid: must be in 1..4 and a multiple of the 2 KV groups"),
    (["--num-heads", "4", "--num-kv-heads", "1"], "4 query heads per KV group is more than the source's 2"),
    (["--experts", "2"], "the llama model is dense: it has no experts to prune"),
    (["--layers", "5"], "--layers 5 is invalid: must be in 1..4"),
    (["--ffn-hidden-size", "49"], "--ffn-hidden-size 49 is invalid: must be in 1..48"),
    (["--target-params", "10000000"], "the source has 39,200 parameters"),
    (["--target-params", "10"], "the smallest model the search reaches has"),
])
def test_bad_requests_exit_2_naming_the_option(llama, tmp_path, calibration, capsys, argv, named):
    assert main(["prune", str(llama), str(tmp_path / "dst"), "--calibration", str(calibration),
                 "--calibration-sequences", "2", "--calibration-length", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("key, value", [("model.layers.2.mlp.up_proj.weight", float("nan")),
                                        ("lm_head.weight", float("inf"))])
def test_non_finite_weights_are_refused_by_name_before_any_work(key, value, llama, tmp_path, calibration, capsys):
    src = with_nonfinite_weight(llama, tmp_path / "src", key, value)
    assert main(["prune", str(src), str(tmp_path / "dst"), "--layers", "2", "--calibration", str(calibration)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"tensor {key!r} (in model.safetensors) is not finite (1 of its" in err and "refusing to prune" in err
    assert not (tmp_path / "dst").exists()


def test_experts_below_top_k_exit_2_and_a_used_destination_exits_1(qwen2_moe, tmp_path, capsys):
    assert main(["prune", str(qwen2_moe), str(tmp_path / "dst"), "--experts", "1"]) == 2
    assert "at least the 2 experts each token is routed to (top_k)" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    assert main(["prune", str(qwen2_moe), str(tmp_path / "used")]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"


# Per family (tests/models/hf_families.py), the sizes it can be pruned to: MLA heads stay; experts routed
# within groups (deepseek_v3's n_group=4) stay; mixtral and qwen3_moe have no dense FFN layer.
FAMILY_SIZES = {
    "llama": dict(n_kv_heads=1, ffn_dim=40), "llama_tied_bias": dict(n_heads=2, ffn_dim=40),
    "mistral": dict(n_kv_heads=1, ffn_dim=40), "qwen2": dict(n_kv_heads=1, ffn_dim=40),
    "qwen3": dict(n_kv_heads=1, ffn_dim=40), "mixtral": dict(n_kv_heads=1, num_experts=3),
    "qwen2_moe": dict(n_kv_heads=1, ffn_dim=40, num_experts=3), "qwen3_moe": dict(n_heads=2, num_experts=3),
    "deepseek_v3": dict(ffn_dim=40), "deepseek_v3_no_qlora": dict(num_experts=3),
}


@pytest.mark.parametrize("family", sorted(FAMILY_SIZES))
def test_every_family_prunes_to_a_directory_transformers_and_tessera_agree_on(family, tmp_path, calibration):
    cfg = hf_configs()[family]
    cfg.vocab_size = 128
    random_hf_model(cfg, seed=2).save_pretrained(tmp_path / "src")
    save_tokenizer(tmp_path / "src")
    r = prune(tmp_path / "src", tmp_path / "dst", PruneSizes(layers=2, **FAMILY_SIZES[family]),
              calibration=[calibration], **CALIBRATION)
    hf = _hf(tmp_path / "dst")
    assert hf.config.num_hidden_layers == 2 and sum(p.numel() for p in hf.parameters()) == r.params
    assert r.params < r.source_params
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp_path / "dst")(_tokens()).logits, hf(_tokens()).logits,
                                   rtol=1e-4, atol=1e-5)


def test_a_bf16_source_stays_bf16_and_keeps_its_generation_config(llama, tmp_path, calibration):
    src = tmp_path / "bf16"
    _hf(llama).to(torch.bfloat16).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((llama / name).read_bytes())
    prune(src, tmp_path / "dst", PruneSizes(layers=3), calibration=[calibration], **CALIBRATION)
    before, after = _weights(src), _weights(tmp_path / "dst")
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert (tmp_path / "dst" / "generation_config.json").read_text() == (src / "generation_config.json").read_text()

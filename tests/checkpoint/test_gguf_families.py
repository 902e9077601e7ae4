"""GGUF files of the families llama.cpp names beyond LLaMA and Qwen2 (phi3, gemma3, olmo2,
seed_oss) load as the transformers model they were written from (fp32 logits, 1e-4): Phi-3's
fused attn_qkv / ffn_up split, its partial rotary, sliding window and LongRoPE tables read;
Gemma 3's sliding pattern, RoPE bases, linear scaling and its norms' +1 taken off; OLMo 2's
post-norms and all-head QK norms; Seed-OSS's q/k/v biases and head size. `tessera convert FILE.gguf OUT` writes a
directory transformers loads with the same logits. Architectures whose family Tessera builds only
from HuggingFace directories are refused by name."""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.gguf import ARCHITECTURES, GGUFFile, load_gguf
from tessera.config.errors import ConfigError
from tessera.models.gguf_linear import GgufLinear
from tests.checkpoint.gguf_family_files import (
    check_convert,
    check_served_greedy,
    tiny_family_model,
    window_ids,
    write_family_gguf,
)

FAMILIES = {"phi3": "phi3", "gemma3": "gemma3_text", "olmo2": "olmo2", "seed_oss": "seed_oss"}


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    files = {}
    for arch in FAMILIES:
        hf = tiny_family_model(arch)
        files[arch] = (write_family_gguf(hf, root / f"tiny-{arch}.gguf", arch), hf)
    return files


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_gguf_gives_transformers_logits(arch, family_files):
    path, hf = family_files[arch]
    model = load_gguf(path)
    assert model.cfg.family == FAMILIES[arch] == ARCHITECTURES[arch].family
    with torch.no_grad():
        torch.testing.assert_close(model(window_ids()).logits, hf(window_ids()).logits, rtol=1e-4, atol=1e-4)
    cfg = model.cfg
    if arch == "phi3":
        assert cfg.partial_rotary_factor == 0.75 and cfg.sliding_window == 7
        assert cfg.rope_scaling["long_factor"] == pytest.approx(hf.config.rope_parameters["long_factor"])
    elif arch == "seed_oss":
        assert cfg.qkv_bias and not cfg.out_bias and cfg.head_dim == 12
    elif arch == "gemma3":
        assert cfg.local_rope_theta == 10000.0 and cfg.rope_theta == 20000.0 and cfg.sliding_window == 4


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_gguf_converts_to_a_directory_transformers_loads(arch, family_files, tmp_path, capsys):
    path, hf = family_files[arch]
    check_convert(path, hf, FAMILIES[arch], tmp_path / "hf", capsys, window_ids())


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_gguf_serves_transformers_greedy_tokens(arch, family_files):
    """The paged engine (sliding windows, Gemma's local layers) decodes the tokens transformers does."""
    path, hf = family_files[arch]
    check_served_greedy(path, hf, window_ids()[0, :9].tolist())


def test_phi3_fused_blocks_kept_quantized_equal_dequantized(tmp_path):
    """Phi-3's fused Q8_0 attn_qkv / ffn_up kept as blocks: each projection its rows of the blocks."""
    path = write_family_gguf(tiny_family_model("phi3", blocks=True), tmp_path / "q8.gguf", "phi3", q8=True)
    kept, plain = load_gguf(path, keep_quantized=True), load_gguf(path)
    layer = kept.layers["0"]
    assert isinstance(layer.attention.wk, GgufLinear) and isinstance(layer.feed_forward.w3, GgufLinear)
    with torch.no_grad():
        torch.testing.assert_close(kept(window_ids()).logits, plain(window_ids()).logits, rtol=1e-4, atol=1e-4)


def test_gemma3_sliding_pattern_from_the_metadata(tmp_path):
    """`attention.sliding_window_pattern` (one flag per layer) replaces llama.cpp's one global layer in six."""
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"] + ["sliding_attention"] * 3
    hf = tiny_family_model("gemma3", seed=3, layer_types=types)
    hf.config.gguf_pattern = True
    model = load_gguf(write_family_gguf(hf, tmp_path / "pattern.gguf", "gemma3"))
    assert model.cfg.window_layers == [i for i, t in enumerate(types) if t == "sliding_attention"]
    with torch.no_grad():
        torch.testing.assert_close(model(window_ids()).logits, hf(window_ids()).logits, rtol=1e-4, atol=1e-4)


def test_olmo3_written_as_olmo2_is_refused_naming_the_window(tmp_path):
    import gguf

    path = tmp_path / "olmo3.gguf"
    writer = gguf.GGUFWriter(str(path), "olmo2")
    writer.add_sliding_window(4096)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"metadata olmo2.attention.sliding_window is not supported"):
        GGUFFile.open(path)


def test_gemma3_norm_offset_is_taken_off(family_files):
    """The file stores 1 + HuggingFace's weight (llama.cpp's convention); Tessera reads HuggingFace's."""
    path, hf = family_files["gemma3"]
    stored = {t.hf_name: t for t in GGUFFile.open(path).stored()}
    name = "model.layers.0.self_attn.q_norm.weight"
    assert stored[name].offset == 1.0
    torch.testing.assert_close(stored[name].dequantized(), hf.state_dict()[name])


@pytest.mark.parametrize("arch,family", [("qwen3moe", "qwen3_moe"), ("qwen3", "qwen3")])
def test_architecture_of_a_family_read_only_from_huggingface_is_refused_by_name(arch, family, tmp_path):
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=rf"GGUF architecture '{arch}' is not supported; supported: llama, "
                                          r"qwen2, phi3, gemma3, olmo2, seed_oss, smollm3, exaone4, glm4moe, "
                                          r"gpt-oss, llama4, qwen3next, qwen35, qwen35moe "
                                          rf"\(Tessera builds the {family} family, but from its HuggingFace directory"):
        GGUFFile.open(path)

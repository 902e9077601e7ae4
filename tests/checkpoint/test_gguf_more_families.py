"""GGUF files of smollm3, exaone4, glm4moe, gpt-oss and llama4 (as llama.cpp's converter writes them) load as
the transformers model they were written from (fp32 logits, 1e-4), convert to a directory
transformers loads with the same logits, and are served by the paged engine with transformers'
greedy tokens: SmolLM3's NoPE layers; EXAONE 4's sliding pattern and Llama 3 RoPE scaling read back
from `rope_freqs`; GLM-4.5's stacked experts, routing bias, dense first layer and skipped
multi-token-prediction block; gpt-oss's sinks, YaRN, and gate / up experts written into
transformers' interleaved fused tensor, also from MXFP4 blocks; Llama 4's routed and dense layers,
fused experts as Tessera's parts, Llama 3 scaling and NoPE layer; Qwen3-Next's Gated DeltaNet layers
(in_proj_qkvz put back together from attn_qkv and attn_gate, A from -exp(A_log), the norms' +1 taken
off all but the DeltaNet's), served through the engine's recurrent-state slots; Qwen3.5's dense and MoE
files (`qwen35`, `qwen35moe`: the DeltaNet projections apart, their value heads put back from
llama.cpp's tiled order into HuggingFace's grouped one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.checkpoint.gguf import ARCHITECTURES, GGUFFile, load_gguf
from tessera.checkpoint.gguf.rope_freqs import llama3_from_rope_freqs, llama3_table
from tessera.config.errors import ConfigError
from tessera.infer import LLM, SamplingParams
from tessera.models.gguf_linear import GgufLinear
from tessera.models.moe.mxfp4_experts import Mxfp4Experts
from tests.checkpoint.gguf_family_files import check_convert, check_served_greedy, window_ids
from tests.checkpoint.gguf_files import tiny_hf_model
from tests.checkpoint.gguf_files import write_gguf as write_llama_gguf
from tests.checkpoint.gguf_more_family_files import ARCHS, LLAMA3, mxfp4_experts, rope_freqs, tiny_model, write_gguf
from tests.infer.tiny_models import hf_greedy


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-more-families")
    out = {}
    for arch in ARCHS:
        hf = tiny_model(arch)
        out[arch] = (write_gguf(hf, root / f"tiny-{arch}.gguf", arch), hf)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_gives_transformers_logits(arch, files):
    path, hf = files[arch]
    model = load_gguf(path)
    assert model.cfg.family == ARCHS[arch] == ARCHITECTURES[arch].family
    with torch.no_grad():
        torch.testing.assert_close(model(window_ids()).logits, hf(window_ids()).logits, rtol=1e-4, atol=1e-4)
    cfg = model.cfg
    if arch == "smollm3":
        assert cfg.nope_layers == [3]
    elif arch == "exaone4":
        assert cfg.window_layers == [0, 2] and cfg.nope_layers == [1, 3]
        assert cfg.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"} | {"low_freq_factor": 1.0}
    elif arch == "glm4moe":
        assert cfg.n_layers == 3 and cfg.moe.first_k_dense == 1 and cfg.partial_rotary_factor == 0.5
    elif arch == "llama4":
        assert cfg.moe_layers == [1, 3] and cfg.nope_layers == [3] and cfg.qk_l2_norm
        assert cfg.attention_chunk_size == 8192 and cfg.rope_scaling["rope_type"] == "llama3"
    elif arch == "qwen3next":
        la = cfg.linear_attention
        assert la.layers == [0, 1, 2] and (la.n_key_heads, la.n_value_heads, la.value_head_dim) == (2, 4, 12)
        assert cfg.partial_rotary_factor == 0.25 and cfg.norm_unit_offset and cfg.moe.shared_expert_gate
    elif arch in ("qwen35", "qwen35moe"):
        la = cfg.linear_attention
        assert la.layers == [0, 1, 2] and la.projections == "split" and (la.n_key_heads, la.n_value_heads) == (2, 4)
        assert (cfg.moe is not None) == (arch == "qwen35moe") and cfg.norm_unit_offset
    else:
        assert cfg.attention_sinks and cfg.window_layers == [0, 2] and cfg.rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_converts_to_a_directory_transformers_loads(arch, files, tmp_path, capsys):
    path, hf = files[arch]
    check_convert(path, hf, ARCHS[arch], tmp_path / "hf", capsys, window_ids())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_serves_transformers_greedy_tokens(arch, files):
    path, hf = files[arch]
    check_served_greedy(path, hf, window_ids()[0, :9].tolist())


def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(tmp_path):
    """llama.cpp's gpt-oss files hold the experts in MXFP4: read through gguf's dequantizer, they give
    the logits of the transformers model whose experts hold the same values."""
    hf = tiny_model("gpt-oss", seed=1)
    mxfp4_experts(hf)
    path = write_gguf(hf, tmp_path / "mxfp4.gguf", "gpt-oss", mxfp4=True)
    kinds = {t.entry.name: t.kind for t in GGUFFile.open(path).stored()}
    assert kinds["blk.0.ffn_gate_exps.weight"] == "MXFP4" and kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
    with torch.no_grad():
        torch.testing.assert_close(load_gguf(path)(window_ids()).logits, hf(window_ids()).logits, rtol=1e-4, atol=1e-4)


def test_llama_file_with_llama3_rope_freqs_gives_the_scaled_transformers_logits(tmp_path):
    """A Llama 3.1 GGUF file (its RoPE scaling only as `rope_freqs`) loads as the llama3-scaled model."""
    from transformers import LlamaForCausalLM

    hf = tiny_hf_model("llama")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048}
    path = write_llama_gguf(hf, tmp_path / "llama31.gguf", ("F32",),
                            extra={"rope_freqs.weight": rope_freqs(scaling, 64, 10000.0)})
    model = load_gguf(path)
    assert model.cfg.rope_scaling == pytest.approx(scaling)
    hf.config.rope_parameters = {**scaling, "rope_theta": 10000.0}
    scaled = LlamaForCausalLM(hf.config).eval()
    scaled.load_state_dict(hf.state_dict())
    with torch.no_grad():
        want = scaled(window_ids()).logits
        assert not torch.allclose(want, hf(window_ids()).logits, rtol=1e-4, atol=1e-4)  # the scaling shows
        torch.testing.assert_close(model(window_ids()).logits, want, rtol=1e-4, atol=1e-4)


def test_gpt_oss_mxfp4_experts_kept_packed_serve_as_dequantized(tmp_path):
    """`keep_quantized`: gpt-oss's MXFP4 experts stay the file's blocks (`Mxfp4Experts`, about a
    quarter of fp16's bytes) and give the logits and greedy tokens of the model dequantized at load."""
    hf = tiny_model("gpt-oss", seed=2)
    mxfp4_experts(hf)
    path = write_gguf(hf, tmp_path / "mxfp4.gguf", "gpt-oss", mxfp4=True)
    kept, plain = load_gguf(path, keep_quantized=True), load_gguf(path)
    experts = kept.layers["0"].moe.experts
    assert isinstance(experts, Mxfp4Experts) and experts.gate_blocks.dtype == torch.uint8
    packed = sum(getattr(experts, f"{n}_blocks").numel() for n in ("gate", "up", "down"))
    dense = plain.layers["0"].moe.experts
    assert packed < 0.3 * 2 * (dense.gate_up_proj.numel() + dense.down_proj.numel())  # 17 / 64 of fp16's bytes
    with torch.no_grad():
        torch.testing.assert_close(kept(window_ids()).logits, plain(window_ids()).logits, rtol=1e-4, atol=1e-4)
    ids = window_ids()[0, :9].tolist()
    llm = LLM(str(path), gguf_keep_quantized=True, max_num_seqs=1, max_model_len=48, block_size=4)
    assert isinstance(llm.engine.model.layers["1"].moe.experts, Mxfp4Experts)
    got = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, ids, 12)


@pytest.mark.parametrize("scaling", [
    LLAMA3,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.1's, over its 64 pairs
])
def test_llama3_scaling_is_read_back_from_its_table(scaling):
    head_dim, theta = (12, 10000.0) if scaling is LLAMA3 else (128, 500000.0)
    table = rope_freqs(scaling, head_dim, theta)
    got = llama3_from_rope_freqs("f.gguf", table.tolist(), head_dim, theta)
    want = {k: v for k, v in scaling.items() if k != "rope_theta"}
    assert got == pytest.approx(want)
    torch.testing.assert_close(llama3_table(got, head_dim, theta), torch.tensor(table, dtype=torch.float64),
                               rtol=1e-6, atol=0)


def test_a_table_that_is_not_llama3_is_refused():
    table = np.linspace(1.0, 3.0, 6)  # rises everywhere: no unscaled short wavelengths
    with pytest.raises(ConfigError, match="'rope_freqs' is not a Llama 3 RoPE scaling table"):
        llama3_from_rope_freqs("f.gguf", table.tolist(), 12, 10000.0)
    with pytest.raises(ConfigError, match="Tessera reads Llama 3's table of 6"):
        llama3_from_rope_freqs("f.gguf", [1.0, 2.0], 12, 10000.0)


def test_qwen35_value_heads_put_back_as_a_row_order_are_kept_as_blocks(tmp_path):
    """`keep_quantized` on a Qwen3.5 file: the DeltaNet projections whose value-head rows llama.cpp stores
    tiled (attn_qkv, attn_gate, ssm_alpha, ssm_beta) stay the file's Q8_0 blocks, rows reordered, with
    the logits of the model dequantized at load; ssm_out, whose columns move, is dequantized."""
    hf = tiny_model("qwen35", seed=1, wide=True)
    path = write_gguf(hf, tmp_path / "q8.gguf", "qwen35", q8=True)
    kept, dense = load_gguf(path, keep_quantized=True), load_gguf(path)
    attention = kept.layers["0"].attention
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
        assert isinstance(getattr(attention, name), GgufLinear) and getattr(attention, name).kind == "Q8_0", name
    assert not isinstance(attention.out_proj, GgufLinear)
    with torch.no_grad():  # (the dequantized load's put-back is proven equal to transformers' above, in F32)
        torch.testing.assert_close(kept(window_ids()).logits, dense(window_ids()).logits, rtol=1e-5, atol=1e-5)


def test_qwen3next_file_whose_ssm_a_is_not_negative_is_refused(tmp_path):
    """llama.cpp stores A = -exp(A_log): a value that is not negative (here NaN) has no A_log."""
    hf = tiny_model("qwen3next", seed=1)
    with torch.no_grad():
        hf.model.layers[1].linear_attn.A_log[0] = float("nan")
    path = write_gguf(hf, tmp_path / "bad-a.gguf", "qwen3next")
    with pytest.raises(ConfigError, match=r"tensor 'blk.1.ssm_a.weight' of shape \[4\] does not fit .*negative"):
        load_gguf(path)

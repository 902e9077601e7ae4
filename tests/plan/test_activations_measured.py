"""The activation estimator against bytes counted on a real model (single CPU process), under
every recomputation and activation policy the trainer runs (applied by its own code).

What is compared: `activation_terms` (the model-level tensors, every layer, the head and loss)
against the distinct storages autograd keeps after forward + loss, counted with
`torch.autograd.graph.saved_tensors_hooks` (tessera.plan.saved_tensors): each storage once
however many ops or views save it; parameters and their autocast copies excluded; storages
autograd frees before backward (unused top-k nodes) excluded. The activations are fp32, bf16
(a bf16 model) or autocast-bf16 (fp32 weights, the trainer's train.dtype: bf16), as named.
The estimator mirrors the model op by op, so these tests ask 0.1%.
"""

from __future__ import annotations

import dataclasses

import pytest

from tessera.config import MLAConfig, MoEConfig, get_preset
from tessera.config.parallel import TORCHTITAN_SAVE
from tessera.models.moe.layer import MoE
from tessera.parallel.memory.activation_offload import HostStore
from tessera.plan.activations import layer_device_host_bytes
from tessera.plan.layout import Layout, Workload
from tessera.plan.saved.activation_terms import head_saved_tensors, layer_saved_tensors, model_saved_tensors
from tests.plan.activation_measurement import build_model, measure_activation_bytes

B, S = 2, 64
DTYPES = ("fp32", "bf16", "autocast-bf16")


def predicted_bytes(cfg, dtype: str, recompute: str, batch: int = B, seq: int = S, device: str = "cuda") -> float:
    tokens = batch * seq
    total = sum(t.nbytes(tokens) for t in model_saved_tensors(cfg, dtype) + head_saved_tensors(cfg, dtype))
    for i in range(cfg.n_layers):
        total += sum(t.nbytes(tokens) for t in layer_saved_tensors(cfg, i, dtype, recompute=recompute,
                                                                   tokens=tokens, batch=batch, device=device))
    return total


def tiny(name: str):
    cfg = get_preset(name)
    if cfg.mla is not None:
        # On CPU, SDPA's flash kernel needs the value head size to equal the query/key head size
        # (otherwise it falls back to the math kernel, which keeps the s x s probabilities).
        cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, v_head_dim=24))
    return cfg


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek"])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_presets_match_counted_bytes(name, recompute, dtype):
    cfg = tiny(name)
    measured = measure_activation_bytes(cfg, dtype, recompute, B, S).total_bytes
    predicted = predicted_bytes(cfg, dtype, recompute)
    assert predicted == pytest.approx(measured, rel=1e-3), (name, dtype, recompute)


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_with_a_narrower_value_head_on_the_cpu(recompute, dtype):
    """DeepSeek's own head sizes (a value head narrower than the query/key head): the CPU's SDPA runs its math
    kernel, which keeps the scaled q and k, the s x s probabilities and a copy of v; planned for device cpu
    (saved_terms.py's `math_attention`), not for cuda, whose memory-efficient kernel takes these sizes."""
    cfg = get_preset("tiny-deepseek")
    measured = measure_activation_bytes(cfg, dtype, recompute, B, S).total_bytes
    assert predicted_bytes(cfg, dtype, recompute, device="cpu") == pytest.approx(measured, rel=1e-9)
    if recompute == "none":
        assert predicted_bytes(cfg, dtype, recompute) < 0.95 * measured


VARIANTS = {
    # Qwen3-style dense: QK norm, QKV and output biases, tied embeddings.
    "qk-norm-bias-tied": get_preset("tiny-llama", qk_norm=True, qkv_bias=True, out_bias=True, tie_embeddings=True),
    # SmolLM3-style: the second layer without RoPE keeps q and k unrotated.
    "nope-layer": get_preset("tiny-llama", family="smollm3", nope_layers=[1]),
    # OLMo 2: RMSNorms after attention and MLP (none before), QK norm over all heads.
    "olmo2-post-norms": get_preset("tiny-llama", family="olmo2", block_norms="post", qk_norm=True,
                                   qk_norm_all_heads=True),
    # OLMo 3: OLMo 2's blocks, a window on the first layer with its own RoPE base, YaRN on the second.
    "olmo3-windows": get_preset("tiny-llama", family="olmo3", block_norms="post", qk_norm=True, qk_norm_all_heads=True,
                                sliding_window=16, window_layers=[0], local_rope_theta=5000.0,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64}),
    # Llama 4: chunks on the rotated layer 0 (an [S, S] mask), temperature on the NoPE layer 1, the weightless
    # QK norm, adjacent rotary pairs, one sigmoid gate scaling each token into its expert beside a shared one.
    "llama4": get_preset("tiny-moe", attention_chunk_size=16, nope_layers=[1], qk_l2_norm=True, nope_attn_scale=0.5,
                         nope_floor_scale=8, rope_interleave=True,
                         moe=MoEConfig(num_experts=8, top_k=1, ffn_dim=64, score_func="sigmoid", norm_topk_prob=False,
                                       gate_input=True, shared_ffn_dim=64)),
    "glm4-moe-partial-rotary": get_preset("tiny-glm4-moe"),  # RoPE tables as wide as the rotated half of a head
    # gpt-oss: attention with sinks (explicit fp32 scores, a bool mask on every layer, the probabilities over
    # keys and sink), a window on the first layer, biased experts with the clamped SwiGLU on interleaved gate / up
    "gpt-oss-sinks-biased-experts": get_preset("tiny-gpt-oss"),
    # Gemma 3: norms before and after, (1 + weight) norms, GeGLU, scaled embeddings, a window with its own base.
    "gemma3-parts": get_preset("tiny-llama", family="gemma3_text", block_norms="pre_post", qk_norm=True,
                               norm_unit_offset=True, activation="gelu_tanh", embed_scale=True,
                               query_pre_attn_scalar=20.0, sliding_window=16, window_layers=[0],
                               local_rope_theta=5000.0),
    # Phi-4-mini: RoPE on three quarters of each head, LongRoPE.
    "phi3-partial-longrope": get_preset("tiny-llama", family="phi3", partial_rotary_factor=0.75, rope_scaling={
        "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}),
    # Megatron's order: top-k on the logits, then a softmax over the k chosen; Switch aux loss.
    "topk-then-softmax": get_preset("tiny-moe", moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=64, aux_loss_coef=0.01,
                                                             softmax_before_topk=False)),
    # Qwen2-MoE style: gated shared expert, no renormalisation, router jitter.
    "shared-gate-jitter": get_preset("tiny-moe", moe=MoEConfig(
        num_experts=8, top_k=4, ffn_dim=32, norm_topk_prob=False, shared_ffn_dim=96, shared_expert_gate=True,
        aux_loss_coef=0.001, jitter_eps=0.01)),
    # Sigmoid scores with expert bias, sequence-level and Switch aux losses, z-loss, shared expert.
    "sigmoid-all-losses": get_preset("tiny-moe", moe=MoEConfig(
        num_experts=8, top_k=2, ffn_dim=32, score_func="sigmoid", seq_aux_loss_coef=1e-4, aux_loss_coef=0.01,
        z_loss_coef=1e-3, expert_bias=True, shared_ffn_dim=32)),
    # MLA without a query latent, RoPE pairs not interleaved.
    "mla-no-q-latent": get_preset("tiny-deepseek", mla=MLAConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                                                 qk_rope_head_dim=8, v_head_dim=24,
                                                                 rope_interleave=False)),
    # Capacity large enough that no slot is dropped, with padding to capacity.
    "capacity-padded": get_preset("tiny-moe", moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=64, capacity_factor=4.0,
                                                           pad_to_capacity=True)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_architecture_variants_match_counted_bytes(variant, dtype):
    cfg = VARIANTS[variant]
    measured = measure_activation_bytes(cfg, dtype, "none", B, S).total_bytes
    assert predicted_bytes(cfg, dtype, "none") == pytest.approx(measured, rel=1e-3), (variant, dtype)


def record_dropped_slots(model) -> list[int]:
    """Wrap every MoE layer's capacity seam (`keep_mask`) to record how many slots each call drops."""
    dropped: list[int] = []
    for moe in model.modules():
        if isinstance(moe, MoE):
            def recording(*args, _inner=moe.keep_mask, **kwargs):
                keep = _inner(*args, **kwargs)
                dropped.append(int((~keep).sum()))
                return keep
            moe.keep_mask = recording
    return dropped


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_capacity_with_drops_matches_counted_bytes(dtype, pad):
    """The local dispatcher's shapes do not depend on the routing (a dropped slot stays a masked
    row), so the count is exact even when the capacity drops slots, as it does here."""
    cfg = get_preset("tiny-moe", moe=MoEConfig(num_experts=8, top_k=2, ffn_dim=64, capacity_factor=0.5,
                                               pad_to_capacity=pad))
    model = build_model(cfg, dtype)
    dropped = record_dropped_slots(model)
    measured = measure_activation_bytes(cfg, dtype, "none", B, S, model=model).total_bytes
    assert len(dropped) == cfg.n_layers and min(dropped) > 0, dropped
    assert predicted_bytes(cfg, dtype, "none") == pytest.approx(measured, rel=1e-3)


def test_everything_but_the_loss_weight_scales_with_tokens():
    """Doubling the batch doubles every saved tensor except nll_loss's scalar weight sum (4 bytes),
    as the estimator's per-token/fixed split says."""
    cfg = get_preset("tiny-moe")
    one = measure_activation_bytes(cfg, "fp32", "none", 1, S).total_bytes
    two = measure_activation_bytes(cfg, "fp32", "none", 2, S).total_bytes
    fixed = sum(t.fixed * t.itemsize for t in head_saved_tensors(cfg, "fp32"))
    fixed += sum(t.fixed * t.itemsize for i in range(cfg.n_layers) for t in layer_saved_tensors(cfg, i, "fp32"))
    assert two - one == one - fixed


DEEPSEEK_SAVE = ("attention_core", "attention_in", "router", "mlp_in")  # DeepSeek-V3's recipe
POLICIES = {  # name: (recompute, interval, recompute_save, activation_fp8, activation_offload)
    "full-every-2nd": ("full", 2, TORCHTITAN_SAVE, (), False),
    "selective-every-2nd": ("selective", 2, TORCHTITAN_SAVE, (), False),
    "op-torchtitan": ("op", 1, TORCHTITAN_SAVE, (), False),
    "op-all-matmuls": ("op", 1, ("matmuls", "attention_core"), (), False),
    "op-core-only": ("op", 1, ("attention_core",), (), False),
    "op-nothing": ("op", 1, ("mla_up",), (), False),  # GQA has no MLA up-projection: only the input stays
    "op-deepseek": ("op", 1, DEEPSEEK_SAVE, (), False),
    "op-deepseek-fp8": ("op", 1, DEEPSEEK_SAVE, ("mlp_in",), False),
    "op-mla-out-every-2nd-fp8": ("op", 2, ("mla_up", "mlp_out", "attention_core"), ("attention_in", "attention_out"),
                                 False),
    "offload": ("none", 1, TORCHTITAN_SAVE, (), True),
    "offload-full": ("full", 1, TORCHTITAN_SAVE, (), True),
    "offload-op-torchtitan": ("op", 1, TORCHTITAN_SAVE, (), True),
}


def planned_device_bytes(cfg, dtype: str, lay: Layout) -> float:
    """What the planner says one process keeps on its device for one micro-batch of B x S: the
    per-layer function the stage estimate uses, the head, and the model-level tensors (only the
    token ids when the blocks offload: the RoPE tables are saved inside them)."""
    work = Workload(seq_len=S, micro_batch=B, global_batch=B)
    tokens = B * S
    model_level = [t for t in model_saved_tensors(cfg, dtype) if t.name == "input_ids" or not lay.activation_offload]
    total = sum(t.nbytes(tokens) for t in model_level + head_saved_tensors(cfg, dtype))
    return total + sum(layer_device_host_bytes(cfg, i, lay, work, dtype)[0] for i in range(cfg.n_layers))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek", "tiny-gpt-oss"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_policy_matches_the_bytes_the_trainer_keeps(name, policy, dtype):
    """The trainer's policies (activation_checkpoint.py, recompute_policy.py, activation_offload.py)
    applied to a real model: the device bytes the planner plans per layer equal the saved tensors
    and policy-cache outputs counted (FP8 copies at one byte plus their fp32 row scales). gpt-oss's
    attention with sinks is an explicit softmax, not an SDPA kernel: with attention_core saved the op
    policy keeps nothing of it (it re-runs), where its output and log-sum-exp were planned (1.02x-1.22x)."""
    cfg = tiny(name)
    recompute, interval, save, fp8, offload = POLICIES[policy]
    store = HostStore() if offload else None
    counted = measure_activation_bytes(cfg, dtype, recompute, B, S, interval=interval, save=save, fp8=fp8,
                                       offload=store).total_bytes
    lay = Layout(recompute=recompute, recompute_interval=interval, recompute_save=save, activation_fp8=fp8,
                 activation_offload=offload)
    assert planned_device_bytes(cfg, dtype, lay) == pytest.approx(counted, rel=1e-3), (name, policy, dtype)
    if offload:
        assert store.packed_bytes > 0 and store.unpacked > 0  # what left the count went to the host store


def test_an_unknown_device_is_refused():
    from tessera.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"device='tpu' is invalid: one of cuda, cpu"):
        layer_saved_tensors(get_preset("tiny-deepseek"), 0, "fp32", device="tpu")

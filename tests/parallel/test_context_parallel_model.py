"""Whole models under context parallelism (`parallelize` with cp=2) against one process: logits
chunk by chunk, the ranks' auxiliary losses adding up to the micro-batch's, and gradients.
Covers what the trainer tests do not: multi-head latent attention (DeepSeek), a sliding window,
layers without RoPE (SmolLM3), OLMo 2's norms, OLMo 3's windows, Gemma 3's parts, Phi-3's LongRoPE
(S = 16 past its original 12: each rank's chunk alone would pick the short table), and expert
capacity, where the tokens dropped must be those one process drops."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera.config import ConfigError, ModelConfig, ParallelError, get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import ModelInput, Transformer
from tessera.models.moe import MoE
from tessera.parallel import ParallelDims, parallelize, shard_global_batch
from tessera.parallel.context_parallel import ChunkPositions
from tessera.parallel.context_parallel_moe import MicroBatchKeepMask
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import full_tensors

B, S = 2, 16


def _moe_preset(**moe) -> ModelConfig:
    base = get_preset("tiny-moe").to_dict()
    return ModelConfig.from_dict({**base, "moe": {**base["moe"], **moe}})


def _config(name: str) -> ModelConfig:
    if name == "mla":
        return get_preset("tiny-deepseek")
    if name == "sliding-window":
        return get_preset("tiny-llama", sliding_window=6)
    if name == "nope":  # SmolLM3: the second layer without RoPE, the first rotated at global positions
        return get_preset("tiny-llama", family="smollm3", nope_layers=[1])
    if name == "olmo3":  # OLMo 2's blocks, a window and its own RoPE base on the first layer, YaRN on the second
        return get_preset("tiny-llama", family="olmo3", block_norms="post", qk_norm=True, qk_norm_all_heads=True,
                          sliding_window=5, window_layers=[0], local_rope_theta=5000.0,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    if name == "exaone4":  # post-norms, per-head QK norm, a window with RoPE on layer 0, layer 1 global without
        return get_preset("tiny-llama", family="exaone4", block_norms="post", qk_norm=True, sliding_window=5,
                          window_layers=[0], nope_layers=[1])
    if name == "chunked":  # Llama 4's chunks on the rotated layer 0, across the ranks' sequence cuts
        return get_preset("tiny-llama", attention_chunk_size=5, nope_layers=[1])
    if name == "llama4":  # and the NoPE layer's temperature at global positions, the weightless QK norm, rotary pairs
        return get_preset("tiny-llama", attention_chunk_size=5, nope_layers=[1], qk_l2_norm=True, nope_attn_scale=0.5,
                          nope_floor_scale=3, rope_interleave=True)
    if name == "gemma3":  # (1 + weight) norms before and after, GeGLU, scaled embeddings, a local window and base
        return get_preset("tiny-llama", family="gemma3_text", block_norms="pre_post", qk_norm=True,
                          norm_unit_offset=True, activation="gelu_tanh", embed_scale=True, query_pre_attn_scalar=20.0,
                          sliding_window=5, window_layers=[0], local_rope_theta=5000.0, tie_embeddings=True)
    if name == "phi3":  # partial rotary; LongRoPE's long table, which the sequence (not a rank's chunk) picks
        return get_preset("tiny-llama", family="phi3", sliding_window=6, partial_rotary_factor=0.5, rope_scaling={
            "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 12,
            "short_factor": [1.0, 1.2, 2.0, 3.0], "long_factor": [1.5, 2.5, 4.0, 8.0]})
    if name == "olmo2":  # norms after attention and MLP, QK norm over all heads
        return get_preset("tiny-llama", family="olmo2", block_norms="post", qk_norm=True, qk_norm_all_heads=True)
    if name == "capacity-probs":
        return _moe_preset(capacity_factor=1.0, drop_policy="probs")
    return _moe_preset(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True)


CONFIGS = ("mla", "sliding-window", "nope", "olmo2", "olmo3", "exaone4", "chunked", "llama4", "capacity-probs",
           "capacity-position-padded", "gemma3", "phi3")


def _batch(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg.vocab_size, (B, S), generator=gen), torch.randn(B, S, cfg.vocab_size, generator=gen)


def _forward_backward(model, tokens, upstream):
    out = model(tokens)
    (torch.sum(out.logits * upstream) + out.aux_loss).backward()
    return out


def _on_rank(name: str) -> dict:
    cfg = _config(name)
    pcfg = ParallelConfig(cp=2, dp_shard=1)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    dims.validate(cfg, dims.world_size, seq_len=S)
    model = parallelize(Transformer(cfg, init_seed=0), dims, pcfg)
    tokens, upstream = (shard_global_batch(t, dims) for t in _batch(cfg))
    out = _forward_backward(model, tokens, upstream)
    grads = full_tensors((n, p.grad) for n, p in model.named_parameters())
    cp_moe = any(isinstance(m, MoE) and isinstance(m.keep_mask, MicroBatchKeepMask) for m in model.modules())
    return {"logits": out.logits.detach(), "aux": out.aux_loss.detach(), "grads": grads, "cp_moe": cp_moe,
            "counts": out.expert_counts}


@pytest.mark.dist
@pytest.mark.parametrize("name", CONFIGS)
def test_model_under_cp_equals_one_process(name):
    cfg = _config(name)
    model = Transformer(cfg, init_seed=0)
    ref = _forward_backward(model, *_batch(cfg))
    got = run_ranks(_on_rank, 2, name)
    torch.testing.assert_close(torch.cat([r["logits"] for r in got], dim=1), ref.logits.detach(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum(r["aux"] for r in got), ref.aux_loss.detach(), rtol=1e-5, atol=1e-7)
    for r in got:
        assert all(torch.equal(r["counts"][k], c) for k, c in ref.expert_counts.items())
        assert r["cp_moe"] == name.startswith("capacity")
    for pname, p in model.named_parameters():
        err = float((got[0]["grads"][pname] - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"gradient of {pname} differs by {err:.2e} (relative norm)"


@pytest.mark.parametrize("parallel,model,seq_len,message", [
    (dict(cp=2, dp_shard=1), {}, 15, "cp=2 does not divide sequence length (train.seq_len)=15"),
    (dict(cp=4, tp=2, sp=True, dp_shard=1), {}, 12,
     "tp=2 does not divide the context-parallel chunk (sequence length 12 / cp=4; sp=true splits it)=3"),
    (dict(cp=2, dp_shard=1, cp_method="ring"), {}, 6,
     "cp_method=ring cuts each sequence into 2 x cp=4 chunks (zig-zag), which does not divide sequence length"),
])
def test_cp_layout_refused_with_what_does_not_fit(parallel, model, seq_len, message):
    cfg = _moe_preset(**model)
    world = parallel["cp"] * parallel.get("tp", 1)
    dims = ParallelDims.from_config(ParallelConfig(**parallel), world)
    with pytest.raises(ParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dims.validate(cfg, world, seq_len=seq_len)


def test_cp_method_other_values_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"parallel.cp_method='ulysses' is invalid: one of alltoall, allgather, ring"):
        ParallelConfig(cp=2, cp_method="ulysses")
    assert ParallelConfig().cp_method == "alltoall"
    assert ParallelDims.from_config(ParallelConfig(cp=2, cp_method="ring", dp_shard=1), 2).cp_layout == "zigzag"


def test_cp_layouts_accepted():
    for parallel, world in ((dict(cp=2, dp_shard=1), 2), (dict(cp=2, dp_shard=2), 4), (dict(cp=2, tp=2), 4),
                            (dict(cp=2, tp=2, sp=True), 4), (dict(cp=2, ep=4, dp_shard=2), 4),
                            (dict(cp=4, dp_shard=1), 4)):
        dims = ParallelDims.from_config(ParallelConfig(**parallel), world)
        dims.validate(_moe_preset(), world, seq_len=16)
        dims.validate(_moe_preset(seq_aux_loss_coef=1e-4), world, seq_len=16)  # per-sequence counts over cp
        dims.validate(_moe_preset(sinkhorn=True), world, seq_len=16)  # Sinkhorn's column sums over cp
        if dims.tp == 1:
            dims.validate(get_preset("tiny-deepseek"), world, seq_len=16)


def test_chunk_positions_are_global_unless_given():
    assert ChunkPositions(cp_rank=1)(2, 4, torch.device("cpu")).tolist() == [[4, 5, 6, 7]] * 2  # chunk 1 of 8
    model = Transformer(get_preset("tiny-llama"), init_seed=0)
    x = torch.randint(0, model.cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    given = torch.arange(4, 8).expand(2, 4)
    want = model(ModelInput(tokens=x, positions=given)).logits
    model.position_source = ChunkPositions(cp_rank=1)
    assert torch.equal(model(x).logits, want)  # the source places the chunk where it belongs
    assert torch.equal(model(ModelInput(tokens=x, positions=given)).logits, want)  # and explicit positions win over it
    assert not torch.equal(model(ModelInput(tokens=x, positions=torch.arange(4).expand(2, 4))).logits, want)

"""A hybrid model (Qwen3-Next: Gated DeltaNet layers beside gated attention, routed experts; Qwen3.5 and
Qwen3.5 MoE: split DeltaNet projections) under data, expert and tensor (+ sequence) parallelism equals
one process (fp32, 1e-5), with sequences of
several DeltaNet chunks, so that the chunked form's state passes from chunk to chunk inside each
rank; under tp each rank runs one of the two key-head groups, its conv channels and heads' gains;
under cp (alone and with tp) each rank runs the recurrent layers (DeltaNet, Kimi delta attention,
Mamba-2) over its own part of the sequence only (contiguous and zig-zag chunks), from the state the
previous part hands on. Kimi Linear (Kimi delta attention, MLA) and Nemotron-H (Mamba-2, attention
without RoPE) run the same layouts. Nemotron-H's MoE variant (relu^2 experts)
under fsdp, ep (also with recompute=op keeping its experts' products), tp and tp + sp equals one process too."""

import dataclasses

import pytest

from tessera.config import get_preset
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import assert_same_step, layout_step, reference_step

SHORT_CHUNKS = {"linear_attention": dataclasses.replace(get_preset("tiny-qwen3-next").linear_attention, chunk_size=4)}


_refs: dict = {}


def _reference(micro: int) -> dict:
    if micro not in _refs:
        _refs[micro] = reference_step("tiny-qwen3-next", micro, SHORT_CHUNKS)
    return _refs[micro]


@pytest.mark.dist
@pytest.mark.parametrize("parallel,micro", [
    (dict(dp_shard=2), 2), (dict(dp_replicate=2, dp_shard=1), 2), (dict(ep=2, dp_shard=2), 2),
    (dict(tp=2, dp_shard=1), 1), (dict(tp=2, sp=True, dp_shard=1), 1)],
    ids=["fsdp2", "replicate2", "ep2-fsdp2", "tp2", "tp2-sp"])
def test_hybrid_layouts_match_one_process(parallel, micro):
    got = run_ranks(layout_step, 2, "tiny-qwen3-next", parallel, config_overrides=SHORT_CHUNKS)
    assert_same_step(got[0], _reference(micro))


@pytest.mark.dist
@pytest.mark.parametrize("parallel,micro", [
    (dict(dp_shard=2), 2), (dict(tp=2, dp_shard=1), 1), (dict(tp=2, sp=True, dp_shard=1), 1),
    (dict(tp=2, dp_shard=1, recompute="op", recompute_save=["attention_in"]), 1)],
    ids=["fsdp2", "tp2", "tp2-sp", "tp2-recompute-op"])
def test_qwen3_5_split_projections_match_one_process(parallel, micro):
    """Qwen3.5's DeltaNet (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; dense MLPs): under tp each
    rank reads its q, k, v rows of in_proj_qkv through the seam, the others cut by value heads; the op
    policy keeps that product (read through the seam) by its role and re-runs the rest."""
    short = {"linear_attention": dataclasses.replace(get_preset("tiny-qwen3.5").linear_attention, chunk_size=4)}
    got = run_ranks(layout_step, 2, "tiny-qwen3.5", parallel, config_overrides=short)
    assert_same_step(got[0], reference_step("tiny-qwen3.5", micro, short))


@pytest.mark.dist
@pytest.mark.parametrize("parallel,micro", [(dict(ep=2, dp_shard=2), 2), (dict(dp_shard=2), 2)],
                         ids=["ep2-fsdp2", "fsdp2"])
def test_qwen3_5_moe_matches_one_process(parallel, micro):
    """Qwen3.5 MoE (split DeltaNet projections, routed experts in every layer): each ep rank holds
    half the experts, fsdp shards the rest; both equal one process."""
    short = {"linear_attention": dataclasses.replace(get_preset("tiny-qwen3.5-moe").linear_attention, chunk_size=4)}
    got = run_ranks(layout_step, 2, "tiny-qwen3.5-moe", parallel, config_overrides=short)
    assert_same_step(got[0], reference_step("tiny-qwen3.5-moe", micro, short))


@pytest.mark.parametrize("parallel,micro", [
    (dict(dp_shard=2), 2), (dict(tp=2, dp_shard=1), 1), (dict(tp=2, sp=True, dp_shard=1), 1)],
    ids=["fsdp2", "tp2", "tp2-sp"])
def test_kimi_linear_matches_one_process(parallel, micro):
    """Kimi Linear (Kimi delta attention, MLA without RoPE, shared experts): under tp each rank runs
    one of the two delta-attention heads (its q, k, v, gate rows; its conv channels, dt_bias and A_log
    through the seam) and half the MLA heads."""
    got = run_ranks(layout_step, 2, "tiny-kimi-linear", parallel, config_overrides=_short("tiny-kimi-linear"))
    assert_same_step(got[0], reference_step("tiny-kimi-linear", micro, _short("tiny-kimi-linear")))


@pytest.mark.parametrize("parallel,micro", [
    (dict(dp_shard=2), 2), (dict(dp_replicate=2, dp_shard=1), 2), (dict(tp=2, dp_shard=1), 1),
    (dict(tp=2, sp=True, dp_shard=1), 1), (dict(tp=2, dp_shard=1, recompute="op", recompute_save=["attention_in"]), 1)],
    ids=["fsdp2", "replicate2", "tp2", "tp2-sp", "tp2-recompute-op"])
def test_nemotron_h_layouts_match_one_process(parallel, micro):
    """Nemotron-H (one sublayer per layer: Mamba-2 with chunks of 4, NoPE attention, relu^2 MLPs); under
    tp each rank runs half the Mamba heads with their group, its rows of in_proj and conv channels read
    through the mixer's seam (which the op policy keeps by its role)."""
    short = {"mamba": dataclasses.replace(get_preset("tiny-nemotron-h").mamba, chunk_size=4)}
    got = run_ranks(layout_step, 2, "tiny-nemotron-h", parallel, config_overrides=short)
    assert_same_step(got[0], reference_step("tiny-nemotron-h", micro, short))


def _nemotron_moe() -> dict:
    """tiny-nemotron-h with its first and third MLP layers made MoE layers (Nemotron-H's MoE variants: relu^2
    experts routed by grouped sigmoid scores with a selection bias, a relu^2 shared expert)."""
    from tessera.config.model import MoEConfig

    sublayers = ["mamba", "moe", "attention", "mlp", "mamba", "moe"]
    moe = MoEConfig(num_experts=4, top_k=2, ffn_dim=32, score_func="sigmoid", expert_bias=True, n_groups=2,
                    topk_groups=1, scaling_factor=2.5, expert_activation="relu2", shared_ffn_dim=48,
                    dense_layers=[i for i, k in enumerate(sublayers) if k != "moe"])
    return {"mamba": dataclasses.replace(get_preset("tiny-nemotron-h").mamba, chunk_size=4), "sublayers": sublayers,
            "moe": moe}


@pytest.mark.dist
@pytest.mark.parametrize("parallel,micro", [
    (dict(dp_shard=2), 2), (dict(ep=2, dp_shard=2), 2), (dict(tp=2, dp_shard=1), 1),
    (dict(tp=2, sp=True, dp_shard=1), 1),
    (dict(ep=2, dp_shard=2, recompute="op", recompute_save=["mlp_in", "mlp_out"]), 2)],
    ids=["fsdp2", "ep2-fsdp2", "tp2", "tp2-sp", "ep2-fsdp2-recompute-op"])
def test_nemotron_h_moe_layouts_match_one_process(parallel, micro):
    """Nemotron-H's MoE layers: under ep each rank holds half the relu^2 experts (under recompute=op keeping
    its experts' up and down products, re-running the rest); under tp each rank holds half of every expert's
    hidden units and of the shared expert's, their partial outputs summed."""
    got = run_ranks(layout_step, 2, "tiny-nemotron-h", parallel, config_overrides=_nemotron_moe())
    assert_same_step(got[0], reference_step("tiny-nemotron-h", micro, _nemotron_moe()))


def _short(preset: str) -> dict:
    """Chunks of 4 tokens for the preset's recurrent layers, so that a rank's part holds several."""
    cfg = get_preset(preset)
    if cfg.mamba is not None:
        return {"mamba": dataclasses.replace(cfg.mamba, chunk_size=4)}
    return {"linear_attention": dataclasses.replace(cfg.linear_attention, chunk_size=4)}


def _cp_batch(vocab: int):
    import torch

    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(3))


def _step(model, tokens, targets, n_tokens: int) -> dict:
    """Forward, backward, one AdamW step and the loss after it; the loss is this process's share of
    (the token losses of the whole batch / its tokens + the auxiliary loss)."""
    import torch

    from tessera.train.objectives.loss import token_loss_sum

    def loss_of(out):
        return token_loss_sum(out.logits, targets) / n_tokens + out.aux_loss

    out = model(tokens)
    loss = loss_of(out)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)
    opt.step()
    with torch.no_grad():
        after = loss_of(model(tokens))
    return {"logits": out.logits.detach(), "loss": loss.detach(), "after": after, "grads": grads}


def _recording_mix(module, seen: list):
    """`module.mix`, recording the shape [rows, tokens] of every input it mixes."""
    mix = module.mix

    def recorded(x, *args, **kwargs):
        seen.append(tuple(x.shape[:2]))
        return mix(x, *args, **kwargs)
    return recorded


def _cp_rank(cp_method: str, preset: str, tp: int, sp: bool = False) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tessera.config.parallel import ParallelConfig
    from tessera.models import Transformer
    from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
    from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
    from tessera.models.linear_attention.mamba2 import Mamba2Mixer
    from tessera.parallel import ParallelDims, global_sum, parallelize, shard_global_batch
    from tessera.parallel.sequence_layout import rank_positions
    from tests.parallel.training_step import full_tensors

    cfg = get_preset(preset, **_short(preset))
    pcfg = ParallelConfig(cp=2, tp=tp, sp=sp, dp_shard=1, cp_method=cp_method)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    dims.validate(cfg, dims.world_size, seq_len=16)
    model = parallelize(Transformer(cfg, init_seed=0), dims, pcfg)
    seen: list = []
    for module in model.modules():
        if isinstance(module, (GatedDeltaNet, KimiDeltaAttention, Mamba2Mixer)):
            module.mix = _recording_mix(module, seen)
    batch = _cp_batch(cfg.vocab_size)
    tokens, targets = (shard_global_batch(t, dims) for t in (batch[:, :-1], batch[:, 1:]))
    got = _step(model, tokens, targets, batch[:, 1:].numel())
    if isinstance(got["logits"], DTensor):  # the vocabulary cut by tp
        got["logits"] = got["logits"].full_tensor()
    return {**got, "loss": global_sum(got["loss"], dims, "cp").item(), "seen": seen,
            "after": global_sum(got["after"], dims, "cp").item(), "grads": full_tensors(got["grads"].items()),
            "weights": full_tensors(model.named_parameters()),
            "positions": rank_positions(8, 2, dims.local_rank("cp"), dims.cp_layout)}


@pytest.mark.dist
@pytest.mark.parametrize("cp_method,preset,tp,sp", [
    ("alltoall", "tiny-qwen3-next", 1, False), ("ring", "tiny-qwen3-next", 1, False),
    ("alltoall", "tiny-qwen3.5", 1, False), ("alltoall", "tiny-kimi-linear", 1, False),
    ("ring", "tiny-kimi-linear", 1, False), ("alltoall", "tiny-nemotron-h", 1, False),
    ("ring", "tiny-nemotron-h", 1, False), ("alltoall", "tiny-qwen3-next", 2, False),
    ("ring", "tiny-nemotron-h", 2, False), ("alltoall", "tiny-qwen3-next", 2, True),
    ("ring", "tiny-qwen3-next", 2, True), ("alltoall", "tiny-nemotron-h", 2, True),
    ("ring", "tiny-nemotron-h", 2, True)],
    ids=["cp2-contiguous", "cp2-ring-zigzag", "qwen3.5-cp2-contiguous", "kimi-linear-cp2-contiguous",
         "kimi-linear-cp2-ring-zigzag", "nemotron-h-cp2-contiguous", "nemotron-h-cp2-ring-zigzag",
         "tp2-cp2-contiguous", "nemotron-h-tp2-cp2-ring-zigzag", "tp2-sp-cp2-contiguous", "tp2-sp-cp2-ring-zigzag",
         "nemotron-h-tp2-sp-cp2-contiguous", "nemotron-h-tp2-sp-cp2-ring-zigzag"])
def test_hybrid_model_under_context_parallelism_equals_one_process(cp_method, preset, tp, sp):
    """A cp=2 step (DeltaNet, Kimi delta attention or Mamba-2 layers: each rank runs them over its own
    part of the sequence, from the state the previous part hands on) equals one process's: logits
    position by position, the loss, every gradient, the weights after one AdamW step and the loss
    after it (fp32, 1e-5). Every recurrent mixer on every rank mixes only its own tokens: one part
    of 8 per sequence (contiguous), or two of 4 as rows of their own (zig-zag), never the 16. Under
    tp2 x cp2 (4 ranks), with or without sequence parallelism, each rank's handoff carries its heads' states
    only."""
    import torch

    from tessera.models import Transformer

    model = Transformer(get_preset(preset, **_short(preset)), init_seed=0)
    batch = _cp_batch(model.cfg.vocab_size)
    ref = _step(model, batch[:, :-1], batch[:, 1:], batch[:, 1:].numel())
    got = run_ranks(_cp_rank, 2 * tp, cp_method, preset, tp, sp)
    logits = torch.empty_like(ref["logits"])
    for r in got:
        logits[:, r["positions"]] = r["logits"]
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-6)
    for key in ("loss", "after"):
        assert abs(got[0][key] - ref[key].item()) <= 1e-5 * abs(ref[key].item()), (key, got[0][key], ref[key])
    for name, p in model.named_parameters():
        err = float((got[0]["grads"][name] - ref["grads"][name]).norm() / ref["grads"][name].norm().clamp_min(1e-30))
        assert err <= 1e-5, f"gradient of {name} differs by {err:.2e} (relative norm)"
        # AdamW's first step moves a weight by lr * g / (|g| + eps): where |g| << eps (1e-3) a gradient
        # element's rounding is scaled by lr / eps = 10, so the weights are held to 10x the 1e-7 an element
        # of a gradient that agrees to 1e-5 in norm may differ by
        torch.testing.assert_close(got[0]["weights"][name], p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    recurrent = sum(1 for i in range(model.cfg.n_layers)
                    if model.cfg.is_linear_attention_layer(i) or model.cfg.is_mamba_layer(i))
    own = (2, 8) if cp_method == "alltoall" else (4, 4)  # [rows, tokens] of the batch's 2 sequences
    for r in got:
        assert r["seen"] == [own] * recurrent * 2  # the step's forward and the one after it


CONFIG = """model:
  preset: tiny-qwen3-next
  vocab_size: 4096
  linear_attention: {chunk_size: 8}
train: {seed: 0, dtype: fp32, grad_clip: 1.0}
data: {kind: pretrain}
"""


def _train(config: str, overrides: list[str]) -> dict:
    from tessera.config.schema import load_config
    from tessera.train.trainer import Trainer
    from tests.parallel.trainer_runs import whole_parameters

    trainer = Trainer(load_config(config, overrides))
    return {"records": trainer.train().records, "weights": whole_parameters(trainer.parts)}


def _as_scales(result: dict) -> dict:
    """The (1 + w) norms' scales in place of their weights, which start at 0 (a relative error of
    a weight near 0 says nothing); the DeltaNet's gated norm scales by its weight itself."""
    offset = {n for n in result["weights"] if n.endswith("norm.weight") and not n.endswith("attention.norm.weight")}
    return {**result, "weights": {n: w + 1 if n in offset else w for n, w in result["weights"].items()}}


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [{"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1f1b"},
                                      {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1},
                                      {"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_method": "ring"}],
                         ids=["pp2-1f1b", "tp2-sp", "cp2-ring"])
def test_trainer_under_pipeline_and_tensor_parallelism_trains_like_one_process(parallel, small_dataset, tmp_path):
    """The real Trainer, three steps: a hybrid model cut into two pipeline stages (DeltaNet layers in
    the first, the attention layer in the second), under tp2 + sp, or under cp2 (ring attention,
    zig-zag chunks), logs one process's losses and ends with its weights."""
    from tests.parallel.trainer_runs import EQUALITY_OVERRIDES, assert_same_training
    from tests.train.runs import shrink

    (tmp_path / "cfg.yaml").write_text(CONFIG)

    def overrides(run_dir, **extra):
        base = shrink(small_dataset, run_dir, 3, **{**EQUALITY_OVERRIDES, **extra})
        return [o for o in base if not o.startswith("model.")] + ["model.max_seq_len=64"]

    ref = _train(str(tmp_path / "cfg.yaml"), overrides(tmp_path / "one"))
    got = run_ranks(_train, 2, str(tmp_path / "cfg.yaml"), overrides(tmp_path / "ranks", **parallel))
    assert_same_training([_as_scales(r) for r in got], _as_scales(ref), rtol=1e-5)

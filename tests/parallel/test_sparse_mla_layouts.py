"""DeepSeek-V3.2's sparse attention (tiny-deepseek-v32: index_topk 8 over 16 tokens, so each query past
the eighth attends to half its keys or fewer) trains under fsdp, tp (the indexer replicated beside the
latent projections, every rank choosing the same keys for its heads), tp + sp and ep x fsdp with one
process's losses, gradients and updated weights (fp32, 1e-5); so does a step with the indexer's KL loss
(train.indexer_loss: its sparse stage, and the dense warm-up with all else frozen), whose target sums the
heads of every tp rank; and under cp (contiguous and zig-zag, and tp2 x cp2), where each rank's queries
take their top-k over the keys of the whole sequence, all-gathered."""

from functools import partial

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.parallel import ParallelDims, global_sum, parallelize, shard_global_batch
from tessera.parallel.sequence_layout import rank_positions
from tessera.train.indexer_loss import train_indexers
from tessera.train.objectives.loss import token_loss_sum
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import assert_same_step, full_tensors, layout_step, reference_step

PRESET = "tiny-deepseek-v32"
_refs: dict = {}


def _reference(micro: int) -> dict:
    if micro not in _refs:
        _refs[micro] = reference_step(PRESET, micro)
    return _refs[micro]


@pytest.mark.dist
@pytest.mark.parametrize("parallel,world,micro", [
    pytest.param(dict(dp_shard=2), 2, 2, id="fsdp2"),
    pytest.param(dict(tp=2, dp_shard=1), 2, 1, id="tp2"),
    pytest.param(dict(tp=2, sp=True, dp_shard=1), 2, 1, id="tp2-sp"),
    pytest.param(dict(ep=2, dp_shard=2), 2, 2, id="ep2-fsdp2"),
])
def test_sparse_attention_layouts_match_one_process(parallel, world, micro):
    got = run_ranks(layout_step, world, PRESET, parallel)
    assert_same_step(got[0], _reference(micro))
    assert "layers.1.attention.wkv_a.weight" in got[0]["grads"]


INDEXER_LOSS = {"sparse": partial(train_indexers, weight=1.0, stage="sparse"),
                "dense": partial(train_indexers, weight=1.0, stage="dense")}


@pytest.mark.dist
@pytest.mark.parametrize("parallel,world,micro,stage", [
    pytest.param(dict(dp_shard=2), 2, 2, "sparse", id="fsdp2-sparse"),
    pytest.param(dict(tp=2, dp_shard=1), 2, 1, "sparse", id="tp2-sparse"),
    pytest.param(dict(tp=2, sp=True, dp_shard=1), 2, 1, "dense", id="tp2-sp-dense"),
    pytest.param(dict(ep=2, dp_shard=2), 2, 2, "sparse", id="ep2-fsdp2-sparse"),
])
def test_the_indexer_loss_under_layouts_matches_one_process(parallel, world, micro, stage):
    over = {"init_std": 0.1}  # attention far enough from uniform that the KL and its gradient are not ~0
    ref = reference_step(PRESET, micro, over, INDEXER_LOSS[stage])
    got = run_ranks(layout_step, world, PRESET, parallel, config_overrides=over, prepare=INDEXER_LOSS[stage])
    assert_same_step(got[0], ref)
    trained = {n for n in ref["grads"] if ".indexer." in n}
    assert trained and (stage == "sparse" or trained == set(ref["grads"]))
    assert all(ref["grads"][n].norm() > 0 for n in trained)


def _cp_step(model, tokens, targets, n_tokens: int) -> dict:
    """Forward, backward, one AdamW step and the loss after it; the loss is this process's share of
    (the token losses of the whole batch / its tokens + the auxiliary losses)."""
    def loss_of(out):
        return token_loss_sum(out.logits, targets) / n_tokens + out.aux_loss

    out = model(tokens)
    loss = loss_of(out)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3, weight_decay=0.1).step()
    with torch.no_grad():
        after = loss_of(model(tokens))
    return {"logits": out.logits.detach(), "loss": loss.detach(), "after": after, "grads": grads,
            "aux": {k: v.detach() for k, v in out.aux_losses.items()}}


def _cp_batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(3))


def _cp_rank(cp_method: str, tp: int, stage: str | None) -> dict:
    pcfg = ParallelConfig(cp=2, tp=tp, dp_shard=1, cp_method=cp_method)
    cfg = get_preset(PRESET, init_std=0.1)
    dims = ParallelDims.from_config(pcfg, torch.distributed.get_world_size())
    dims.validate(cfg, dims.world_size, seq_len=16)
    model = Transformer(cfg, init_seed=0)
    if stage is not None:
        INDEXER_LOSS[stage](model)
    model = parallelize(model, dims, pcfg)
    seen = []
    for m in model.modules():
        if isinstance(m, SparseLatentAttention):
            m.sequence = _recording(m.sequence, seen)
    batch = _cp_batch(cfg.vocab_size)
    tokens, targets = (shard_global_batch(t, dims) for t in (batch[:, :-1], batch[:, 1:]))
    got = _cp_step(model, tokens, targets, batch[:, 1:].numel())
    if isinstance(got["logits"], DTensor):  # the vocabulary cut by tp
        got["logits"] = got["logits"].full_tensor()
    return {**got, "loss": global_sum(got["loss"], dims, "cp").item(), "seen": seen,
            "after": global_sum(got["after"], dims, "cp").item(), "grads": full_tensors(got["grads"].items()),
            "aux": {k: global_sum(v, dims, "cp").item() for k, v in got["aux"].items()},
            "weights": full_tensors(model.named_parameters()),
            "positions": rank_positions(8, 2, dims.local_rank("cp"), dims.cp_layout)}


def _recording(sequence, seen: list):
    """The `sequence` seam, recording (this rank's queries, the keys they are offered) of every call."""
    def recorded(k, v, keys):
        out = sequence(k, v, keys)
        seen.append((k.shape[2], out[0].shape[2]))
        return out
    return recorded


@pytest.mark.dist
@pytest.mark.parametrize("cp_method,tp,stage", [
    ("alltoall", 1, None), ("allgather", 1, None), ("ring", 1, "sparse"), ("alltoall", 2, "sparse"),
    ("allgather", 1, "dense")],
    ids=["cp2-contiguous", "cp2-allgather-zigzag", "cp2-ring-zigzag-indexer-loss", "tp2-cp2-indexer-loss",
         "cp2-zigzag-dense-warm-up"])
def test_context_parallelism_equals_one_process(cp_method, tp, stage):
    """A cp=2 step of 16-token sequences (each rank 8 tokens, contiguous or zig-zag) equals one process's:
    logits position by position, the loss, every gradient, the weights after one AdamW step and the loss
    after it (fp32, 1e-5); with the indexer loss its per-layer KL too. Each rank's sparse layers score
    their 8 queries against all 16 keys of the sequence."""
    model = Transformer(get_preset(PRESET, init_std=0.1), init_seed=0)
    if stage is not None:
        INDEXER_LOSS[stage](model)
    batch = _cp_batch(model.cfg.vocab_size)
    ref = _cp_step(model, batch[:, :-1], batch[:, 1:], batch[:, 1:].numel())
    got = run_ranks(_cp_rank, 2 * tp, cp_method, tp, stage)
    logits = torch.empty_like(ref["logits"])
    for r in got:
        logits[:, r["positions"]] = r["logits"]
    # fp32 1e-5 of the logits' scale: tp's partial sums add in another order (a few elements near 0 move ~1e-6)
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5 * float(ref["logits"].abs().max()))
    for key in ("loss", "after"):
        assert abs(got[0][key] - ref[key].item()) <= 1e-5 * abs(ref[key].item()), (key, got[0][key], ref[key])
    assert got[0]["aux"].keys() == ref["aux"].keys()
    for name, value in ref["aux"].items():
        assert abs(got[0]["aux"][name] - value.item()) <= 1e-5 * abs(value.item()) + 1e-9, name
    assert (stage is None) == ("layer0/indexer_kl" not in ref["aux"])
    for name, g in ref["grads"].items():
        err = float((got[0]["grads"][name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"gradient of {name} differs by {err:.2e} (relative norm)"
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[0]["weights"][name], p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for r in got:
        assert r["seen"] == [(8, 16)] * model.cfg.n_layers * 2  # the step's forward and the one after it

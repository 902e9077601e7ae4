"""`train.compile` on MoE blocks: compiled whole (routing, dispatch, grouped expert GEMMs and
attention in one graph) where the MoE layer traces as one graph, in bf16 on a local dispatcher, and
only their attention half elsewhere (tessera.parallel.compile says why); whole-block compiled
bf16 training follows eager bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config import get_preset
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.models.moe.dispatcher import LocalDispatcher
from tessera.parallel.compile import compile_blocks
from tessera.train.trainer import Trainer
from tests.parallel.trainer_runs import overrides_for
from tests.train.runs import TINY_MOE


def _moe_model(**moe_changes) -> Transformer:
    cfg = get_preset("tiny-moe")
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe_changes))
    return Transformer(cfg, init_seed=0)


class _OtherDispatcher:
    """Stands for an expert-parallel dispatcher (which reads split sizes on the host)."""

    def __init__(self, local: LocalDispatcher):
        self.local = local

    def dispatch(self, *args):
        return self.local.dispatch(*args)

    def combine(self, *args):
        return self.local.combine(*args)


def test_moe_blocks_compile_whole_only_where_they_trace_as_one_graph():
    moe_blocks = [k for k, b in _moe_model().layers.items() if hasattr(b, "moe")]
    assert moe_blocks
    whole = {f"layers.{k}" for k in moe_blocks}
    halves = {f"layers.{k}.attention" for k in moe_blocks}
    assert whole <= set(compile_blocks(_moe_model(), torch.bfloat16))
    for model, dtype in ((_moe_model(), None), (_moe_model(), torch.float16),
                         (_moe_model(grouped_gemm=False), torch.bfloat16)):
        assert halves <= set(compile_blocks(model, dtype)) and not whole & set(compile_blocks(model, dtype))
    model = _moe_model()
    for k in moe_blocks:
        model.layers[k].moe.dispatcher = _OtherDispatcher(model.layers[k].moe.dispatcher)
    assert halves <= set(compile_blocks(model, torch.bfloat16))
    # context parallelism sums the routing counts over ranks (collectives, a host read)
    model = _moe_model()
    for k in moe_blocks:
        model.layers[k].moe.router.reduce_counts = lambda counts, n: (counts, n)
    assert halves <= set(compile_blocks(model, torch.bfloat16))
    # Sinkhorn stops iterating on a tolerance read on the host: a graph break per iteration
    assert halves <= set(compile_blocks(_moe_model(sinkhorn=True), torch.bfloat16))


@pytest.mark.slow
def test_bf16_moe_model_trains_compiled_whole_like_eager(small_dataset, tmp_path):
    """The trainer in bf16 compiles each MoE block whole; 3 steps within the bf16 contract's 5e-3
    of eager bf16 (inductor fuses bf16 arithmetic, so not bit for bit)."""
    losses = {}
    for flag in (False, True):
        torch._dynamo.reset()
        trainer = Trainer(load_config(TINY_MOE, overrides_for("moe", small_dataset, tmp_path / str(flag), 3, **{
            "train.dtype": "bf16", "train.compile": flag})))
        moe_blocks = [b for b in trainer.model.layers.values() if hasattr(b, "moe")]
        assert moe_blocks and all(getattr(b, "compiled", False) == flag for b in moe_blocks)
        losses[flag] = trainer.train().records
    assert len(losses[True]) == 3
    for r, w in zip(losses[True], losses[False], strict=True):
        assert abs(r["loss"] - w["loss"]) <= 5e-3 * w["loss"], (r, w)
        assert abs(r["aux_loss"] - w["aux_loss"]) <= 5e-2 * w["aux_loss"], (r, w)

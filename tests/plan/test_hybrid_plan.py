"""The planner sizes a hybrid model's recurrent layers (Gated DeltaNet, Kimi delta attention, Mamba-2) as
themselves, not as attention layers: the parameters one rank holds equal the real model's, on one process,
per pipeline stage and under tensor parallelism (the trainer's own plan applied on real gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.plan.layout import Layout, stage_layers
from tessera.plan.memory import rank_params
from tests.forked_ranks import run_ranks

HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h", "tiny-qwen3.5-moe"]


@pytest.mark.parametrize("name", HYBRIDS)
def test_one_rank_holds_the_built_models_parameters(name):
    cfg = get_preset(name)
    (only,) = rank_params(cfg, Layout())
    assert only.total == sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_each_pipeline_stage_holds_its_layers_parameters(name):
    """Per stage against the real model's parameters of that stage's layers (and the ends' embedding, head)."""
    cfg = get_preset(name)
    model = Transformer(cfg)
    stages = stage_layers(cfg.n_layers, 2)
    for s, got in enumerate(rank_params(cfg, Layout(pp=2))):
        keep = tuple(f"layers.{i}." for i in stages[s]) + (("tok_embeddings",) if s == 0 else ("norm.", "output."))
        want = sum(p.numel() for n, p in model.named_parameters() if n.startswith(keep))
        assert got.total == want, (name, s)


def _local_parameters(name: str) -> int:
    """One rank's parameter elements after the trainer's tp=2 plan (DTensors: this rank's part)."""
    from tessera.parallel import parallelize
    from tessera.parallel.dims import ParallelDims

    cfg = get_preset(name)
    pcfg = ParallelConfig(tp=2, dp_shard=1)
    dims = ParallelDims.from_config(pcfg, 2)
    dims.validate(cfg, 2, seq_len=16)
    dims.build_mesh("cpu")
    model = parallelize(Transformer(cfg), dims, pcfg)
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h"])
def test_a_tensor_parallel_rank_holds_what_the_trainers_plan_leaves_it(name):
    """tp=2: heads and projections cut, the convolutions, gains and (Qwen3.5's in_proj_qkv, Mamba-2's in_proj)
    the tensors read through the mixers' `own_part` seams whole on every rank."""
    torch.manual_seed(0)
    got = run_ranks(_local_parameters, 2, name)
    (planned,) = rank_params(get_preset(name), Layout(tp=2))
    assert got[0] == got[1] == planned.total

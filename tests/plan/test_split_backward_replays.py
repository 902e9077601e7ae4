"""The planner's count of recomputed blocks' replays is the trainer's, per pipeline schedule. torch's split
backward (zero_bubble, zbv, dualpipev) takes the weights' gradients one autograd group at a time, and a
block checkpointed by full or operator-level recomputation replays its forward in each of those calls:
counted here on a real pipeline step (pp2 on two gloo ranks, the trainer's own `build_pipeline` and
recomputation), as forwards of each block's mixer in the second step beyond one per micro-batch, against
`layer_replays` (tessera/plan/bubble.py). DualPipeV's split micro-batches at more stages: torch's own
action lists against `split_backwards`. The weight groups of every family's layers (what the weight pass
calls autograd on, one call each): torch's own grouping (`stage_backward_input`'s parameter groups) against
`layer_weight_groups`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input
from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _ComputationType

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.models.counting import layer_weight_groups
from tessera.parallel import ParallelDims, parallelize, shard_global_batch
from tessera.parallel.pipeline import build_pipeline
from tessera.plan.bubble import layer_replays, split_backwards
from tessera.plan.layout import PLANNED_AS
from tessera.train.objectives.loss import token_loss_sum
from tests.forked_ranks import run_ranks
from tests.parallel.training_step import SEED, global_batch

M = 4
DEEPSEEK = ("attention_core", "attention_in", "router", "mlp_in")
RUNS = {"full": ("tiny-llama", {"recompute": "full"}),
        "op": ("tiny-deepseek", {"recompute": "op", "recompute_save": DEEPSEEK})}


def _replays(schedule: str, run: str, pp: int) -> int:
    """Blocks' forwards on this rank in a step beyond one per block and micro-batch (the first step
    excluded: the stages' shape inference runs forwards of its own)."""
    preset, policy = RUNS[run]
    pcfg = ParallelConfig(pp=pp, dp_shard=1, pp_schedule=schedule, optimizer="distributed", **policy)
    cfg = get_preset(preset, n_layers=8)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    batch = global_batch(cfg.vocab_size, rows=M if schedule != "dualpipev" else 2 * pp)
    m = batch.shape[0]
    tokens = batch[:, 1:].numel()
    pipe = build_pipeline(Transformer(cfg, init_seed=SEED), dims, pcfg, m,
                          loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / tokens, aux_scale=1.0 / m,
                          parallelize_stage=lambda module: parallelize(module, dims, pcfg))
    calls, blocks = [0], 0
    for module in pipe.modules:
        for block in module.layers.values():
            blocks += 1
            mixer = next(x for name, x in block.named_modules() if name.endswith("attention"))
            mixer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    rows = shard_global_batch(batch, dims)
    pipe.step(rows[:, :-1], rows[:, 1:])
    calls[0] = 0
    pipe.step(rows[:, :-1], rows[:, 1:])
    return calls[0] - m * blocks


def _planned(schedule: str, run: str, pp: int, rank: int) -> float:
    preset, policy = RUNS[run]
    m = M if schedule != "dualpipev" else 2 * pp
    replays = layer_replays(get_preset(preset, n_layers=8), PLANNED_AS.get(schedule, schedule), pp, m,
                            policy["recompute"])
    return sum(m * r for r_rank, r in replays if r_rank == rank)


@pytest.mark.dist
@pytest.mark.parametrize("run", ["full", "op"])
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble", "zbv", "dualpipev"])
def test_planned_replays_are_the_trainers(schedule, run):
    got = run_ranks(_replays, 2, schedule, run, 2)
    assert got == [_planned(schedule, run, 2, rank) for rank in range(2)]
    if schedule != "1f1b":  # the split backward replays more than once per micro-batch
        assert sum(got) > sum(_planned("1f1b", run, 2, rank) for rank in range(2))


@pytest.mark.dist
def test_dualpipev_replays_at_four_stages_are_the_trainers():
    got = run_ranks(_replays, 4, "dualpipev", "full", 4)
    assert got == [_planned("dualpipev", "full", 4, rank) for rank in range(4)]


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_dualpipev_splits_the_backwards_torchs_action_lists_split(p):
    """Each stage's input-only backwards in torch's DualPipeV (the first stage's is its whole backward:
    its input needs no gradient, so it replays once) against the planner's split micro-batches."""
    m = 4 * p
    split: dict[int, int] = {}
    for rank in range(p):
        actions = ScheduleDualPipeV._calculate_single_rank_operations(
            SimpleNamespace(pp_group_size=p, _n_microbatches=m), rank)
        for action in filter(None, actions):
            for a in action.sub_actions or (action,):
                if a.computation_type == _ComputationType.BACKWARD_INPUT and a.stage_index > 0:
                    split[a.stage_index] = split.get(a.stage_index, 0) + 1
    planned = split_backwards("dualpipe", 2 * p, p, m)  # one layer a stage: layer s is stage s
    assert {s: n for s, (_, n) in enumerate(planned) if s > 0} == split


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek", "tiny-glm4-moe", "tiny-gpt-oss",
                                  "tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-kimi-linear",
                                  "tiny-nemotron-h"])
def test_weight_groups_are_torchs_groups_of_the_split_backward(name):
    """The decoder layers as one pipeline stage from the embedding's output (a tensor needing a gradient, as a
    stage's input is): torch groups their weights as the planner counts them."""
    cfg = get_preset(name)
    model = Transformer(cfg, init_seed=SEED)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.tok_embeddings(ids).clone().requires_grad_()
    model.tok_embeddings.register_forward_hook(lambda *_: hidden)
    logits = model(ids).logits
    weights = [p for n, p in model.named_parameters() if n.startswith("layers.")]
    _, groups = stage_backward_input([logits], [torch.ones_like(logits)], [hidden], weights)
    assert len(groups) == sum(layer_weight_groups(cfg, i) for i in range(cfg.n_layers))

"""The planner's data-parallel collectives equal what the trainer's FSDP2 does, call for call and
byte for byte, under gradient accumulation: weights gathered for every micro-batch (twice for the
blocks under ZeRO-3), gradients reduce-scattered once per step. The trainer's side is
`log.comm_stats` (tessera.parallel.comm_stats, summed over ranks); the planner's is
`stage_collectives` for the same model, layout and batch."""

from __future__ import annotations

import pytest

from tessera.config.schema import load_config
from tessera.plan.comm import stage_collectives
from tessera.plan.estimate import precisions_for_train_dtype
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import get_precision, rank_params
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import MODELS, overrides_for, train_on_ranks
from tests.train.runs import build_small_dataset

KINDS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}
STEPS = 2


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> str:
    return build_small_dataset(tmp_path_factory.mktemp("data"))


def _planned(model: str, overrides: list[str], world: int) -> dict[str, tuple[float, float]]:
    """(calls, payload bytes) per rank and step of the planner's all-gathers and reduce-scatters."""
    cfg = load_config(MODELS[model][0], overrides)
    t = cfg.train
    lay = Layout.from_parallel(cfg.parallel, world)
    work = Workload(t.seq_len, t.micro_batch_size, t.global_batch_size)
    precision, act_dtype = precisions_for_train_dtype(t.dtype)
    colls = stage_collectives(cfg.model, lay, work, 0, rank_params(cfg.model, lay)[0], get_precision(precision),
                              act_dtype)
    m = lay.microbatches(work)
    assert m == 2  # the point: several micro-batches per step
    out = dict.fromkeys(KINDS.values(), (0.0, 0.0))
    for c in colls:
        assert c.group in ("dp_shard", "ep_dp"), c  # nothing else in these layouts
        calls = c.calls_per_microbatch * m + c.calls_per_step
        done_calls, done_bytes = out[KINDS[c.op]]
        out[KINDS[c.op]] = (done_calls + calls, done_bytes + calls * c.size)
    return out


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [
    ("dense", {"parallel.dp_shard": 2, "parallel.zero_stage": 3}),
    ("moe", {"parallel.dp_shard": 2, "parallel.zero_stage": 2}),
], ids=["dense-fsdp2-zero3", "moe-fsdp2-zero2"])
def test_planner_counts_the_trainers_collectives_under_accumulation(model, layout, small_dataset, tmp_path):
    world = 2
    # Global batch 4 over 2 data-parallel ranks in micro-batches of 1: 2 micro-batches per rank.
    overrides = overrides_for(model, small_dataset, tmp_path, STEPS, **layout,
                              **{"train.micro_batch_size": 1, "log.comm_stats": True})
    planned = _planned(model, overrides, world)
    records = run_ranks(train_on_ranks, world, model, overrides)[0]["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for rec in records:
        for kind, (calls, nbytes) in planned.items():
            assert calls > 0
            assert rec[f"comm/{kind}_calls"] == world * calls, (kind, rec[f"comm/{kind}_calls"], world * calls)
            assert rec[f"comm/{kind}_bytes"] == world * nbytes, (kind, rec[f"comm/{kind}_bytes"], world * nbytes)


HYBRIDS = {"qwen3-next": "model:\n  preset: tiny-qwen3-next\n  vocab_size: 4096\n  linear_attention: {chunk_size: 8}\n",
           "nemotron-h": "model:\n  preset: tiny-nemotron-h\n  vocab_size: 4096\n  mamba: {chunk_size: 8}\n"}
HYBRID_RUN = "train: {seed: 0, dtype: fp32, grad_clip: 1.0}\ndata: {kind: pretrain}\n"
COUNTED = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all",
           "send_recv": "send/recv"}


def _hybrid_run(config: str, overrides: list[str]) -> list[dict]:
    from tessera.train.trainer import Trainer

    return Trainer(load_config(config, overrides)).train().records  # rank 0's: the counts summed over ranks


def _hybrid_step(model: str, dataset: str, run_dir, world: int, **parallel) -> tuple[dict, dict]:
    """(what the planner counts, what the trainer's one step moved, summed over ranks), each as
    {kind: (calls, payload bytes)} for one step of 4 micro-batches of one sequence per rank."""
    from tests.train.runs import shrink

    run_dir.mkdir()
    config = run_dir / "hybrid.yaml"
    config.write_text(HYBRIDS[model] + HYBRID_RUN)
    base = shrink(dataset, run_dir, 1, **{"train.micro_batch_size": 1, "checkpoint.interval": 0,
                                          "log.comm_stats": True, **parallel})
    overrides = [o for o in base if not o.startswith("model.")] + ["model.max_seq_len=64"]
    cfg = load_config(str(config), overrides)
    t = cfg.train
    lay = Layout.from_parallel(cfg.parallel, world)
    work = Workload(t.seq_len, t.micro_batch_size, t.global_batch_size)
    precision, act_dtype = precisions_for_train_dtype(t.dtype)
    colls = stage_collectives(cfg.model, lay, work, 0, rank_params(cfg.model, lay)[0], get_precision(precision),
                              act_dtype)
    assert lay.microbatches(work) == 4
    planned = {}
    for kind, op in COUNTED.items():
        calls = [(c.calls_per_microbatch * 4 + c.calls_per_step, c.size) for c in colls if c.op == op]
        planned[kind] = (world * sum(n for n, _ in calls), world * sum(n * size for n, size in calls))
    (record,) = run_ranks(_hybrid_run, world, str(config), overrides)[0]
    return planned, {k: (record.get(f"comm/{k}_calls", 0), record.get(f"comm/{k}_bytes", 0)) for k in COUNTED}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("model, cp_method, recompute",
                         [("qwen3-next", "alltoall", "full"), ("nemotron-h", "ring", "none")],
                         ids=["qwen3-next-cp2-alltoall-full-recompute", "nemotron-h-cp2-ring"])
def test_planner_counts_the_recurrent_layers_state_handoff_under_context_parallelism(model, cp_method, recompute,
                                                                                      small_dataset, tmp_path):
    """A hybrid model under cp=2: what context parallelism moves in a real step (the trainer's
    `log.comm_stats`, a cp=2 run's collectives less those of a dp_shard=2 run with the same FSDP
    shards and micro-batches; the planner's difference cancels its FSDP figures the same way) is what
    the planner counts: the recurrent layers' state handoff (every
    part's conv inputs, transitions and end states all-gathered, their gradients reduce-scattered),
    call for call and byte for byte, and attention's exchange (Ulysses' all-to-alls, byte for byte;
    ring's sends, call for call) for the attention layers only; Nemotron-H's MLP layers move nothing. Under
    full recomputation the recomputed forward gathers again."""
    plan_dp, ran_dp = _hybrid_step(model, small_dataset, tmp_path / "dp", 2, **{
        "parallel.dp_shard": 2, "train.global_batch_size": 8, "parallel.recompute": recompute})
    plan_cp, ran_cp = _hybrid_step(model, small_dataset, tmp_path / "cp", 2, **{
        "parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_method": cp_method, "train.global_batch_size": 4,
        "parallel.recompute": recompute})
    moved = {k: (ran_cp[k][0] - ran_dp[k][0], ran_cp[k][1] - ran_dp[k][1]) for k in COUNTED}
    counted = {k: (plan_cp[k][0] - plan_dp[k][0], plan_cp[k][1] - plan_dp[k][1]) for k in COUNTED}
    for kind, (calls, nbytes) in moved.items():
        assert nbytes == counted[kind][1], (kind, moved, counted)
        if kind != "all_to_all":  # the planner counts Ulysses' q, k, v and output as one all-to-all a pass
            assert calls == counted[kind][0], (kind, moved, counted)
    exchange = "send_recv" if cp_method == "ring" else "all_to_all"
    assert moved["all_gather"][1] > 0 and moved["reduce_scatter"][1] > 0 and moved[exchange][1] > 0


def _handoff_gathers(cp_method: str, preset: str) -> list[tuple[int, ...]]:
    """A tp2 x cp2 step of `preset` (tests/parallel/test_hybrid_layouts.py's), tracing the bytes each state
    handoff gathers: per call, every tensor's gathered size (2 cp ranks' rows)."""
    import tessera.parallel.context_parallel_recurrent as recurrent
    from tests.parallel.test_hybrid_layouts import _cp_rank

    gather, seen = recurrent.gather_rows_then, []

    def traced(fn, group, *tensors):
        seen.append(tuple(2 * t.numel() * t.element_size() for t in tensors))
        return gather(fn, group, *tensors)

    recurrent.gather_rows_then = traced
    _cp_rank(cp_method, preset, 2)
    return seen


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("preset, cp_method", [("tiny-qwen3-next", "alltoall"), ("tiny-nemotron-h", "ring"),
                                               ("tiny-kimi-linear", "ring")])
def test_planned_handoff_buffers_are_what_a_tp2_cp2_step_gathers(preset, cp_method):
    """Under tp2 x cp2 each rank's state handoff gathers its heads' and channels' share: every gather of a
    real step (the conv inputs; the transitions and end states) is the size the planner gives each buffer
    (`handoff_buffers`) for the layout, one part a rank (contiguous) or two (zig-zag)."""
    from tessera.config import get_preset
    from tessera.plan.profile import handoff_buffers
    from tests.parallel.test_hybrid_layouts import _short

    cfg = get_preset(preset, **_short(preset))
    planned = handoff_buffers(cfg, "ssd" if cfg.mamba is not None else "delta",
                              Layout(tp=2, cp=2, cp_method=cp_method), 2, 4)  # 2 sequences, fp32
    conv, states = (planned["convolution inputs"],), (planned["transitions"], planned["end states"])
    for rank in run_ranks(_handoff_gathers, 4, cp_method, preset):
        assert rank and set(rank) == {conv, states} and rank.count(conv) == rank.count(states), rank

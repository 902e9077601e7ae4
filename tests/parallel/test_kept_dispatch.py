"""`recompute_save: [..., dispatch]` (tessera/parallel/memory/kept_exchange.py): a recomputed MoE block
keeps its expert all-to-alls' received rows, so its replay in backward sends nothing and backward sends
only the gradients' all-to-alls (DeepSeek-V3's 4 per MoE layer and micro-batch, where the plain operator
policy sends 6 and exchanges the counts again). Two gloo ranks, ep2, the tiny MoE model: every
all-to-all traced by phase, gradients equal to no recomputation in fp32 within 1e-5. Under DualPipeV
(pp2 x ep2, the pairs overlapped) the forward keeps on the worker thread and the replay takes on the
caller's, twice where the backward is split into its input and weight passes."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.config import ParallelError, get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.parallel import ParallelDims, parallelize, shard_global_batch
from tessera.parallel.memory.kept_exchange import ExchangeRecord, Keeping, exchange_counts
from tessera.parallel.pipeline import build_pipeline
from tessera.plan.activations import layer_terms
from tessera.plan.comm import stage_collectives
from tessera.plan.layout import Layout, Workload
from tessera.plan.memory import get_precision, rank_params
from tessera.plan.saved.recompute_terms import kept_exchanges
from tessera.train.objectives.loss import token_loss_sum
from tests.forked_ranks import run_ranks
from tests.parallel.test_dualpipe_overlap import LAYOUT as PIPELINE_LAYOUT
from tests.parallel.trainer_runs import overrides_for, train_on_ranks
from tests.parallel.training_step import SEED, global_batch

DEEPSEEK = ("attention_core", "attention_in", "router", "mlp_in")
POLICIES = {"none": {"recompute": "none"},
            "op": {"recompute": "op", "recompute_save": DEEPSEEK},
            "kept": {"recompute": "op", "recompute_save": (*DEEPSEEK, "dispatch")},
            "kept-fp8": {"recompute": "op", "recompute_save": (*DEEPSEEK, "dispatch"), "activation_fp8": ("dispatch",)},
            "compute": {"recompute": "none", "ep_dispatch_dtype": "compute"},
            "kept-compute": {"recompute": "op", "recompute_save": (*DEEPSEEK, "dispatch"),
                             "ep_dispatch_dtype": "compute"}}


def _step(policy: str, autocast: bool = False) -> dict:
    """Forward and backward of one micro-batch per rank, each all-to-all counted by phase, the bytes
    the blocks' policies keep counted (their observers)."""
    pcfg = ParallelConfig(dp_shard=2, ep=2, optimizer="distributed", **POLICIES[policy])
    cfg = get_preset("tiny-moe")
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    model = parallelize(Transformer(cfg, init_seed=SEED), dims, pcfg)
    kept = [0]
    for block in model.layers.values():
        if hasattr(block, "recompute_policy"):
            block.recompute_policy.observers.append(lambda t: kept.__setitem__(0, kept[0] + t.nbytes))
    batch = global_batch(cfg.vocab_size)
    rows = shard_global_batch(batch, dims)
    calls, phase, real = {"forward": 0, "backward": 0}, ["forward"], dist.all_to_all_single

    row_calls = [0, 0]  # the row exchanges (not the counts'): calls, bytes received

    def traced(*args, **kwargs):  # counts what the real collective does, then runs it
        calls[phase[0]] += 1
        if args[0].is_floating_point():
            row_calls[0] += 1
            row_calls[1] += args[0].nbytes
        return real(*args, **kwargs)

    dist.all_to_all_single = traced
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(rows[:, :-1])
            loss = token_loss_sum(out.logits, rows[:, 1:]) / batch[:, 1:].numel() + out.aux_loss
        phase[0] = "backward"
        loss.backward()
    finally:
        dist.all_to_all_single = real
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    return {"calls": calls, "row_calls": row_calls[0], "row_bytes": row_calls[1], "moe_layers": moe_layers,
            "loss": loss.item(), "kept_bytes": kept[0],
            "planned": _planned_row_exchanges(cfg, pcfg, rows[:, :-1].shape, "autocast-bf16" if autocast else "fp32"),
            "tokens": rows[:, :-1].numel(),
            "grads": {n: _local(p.grad) for n, p in model.named_parameters()}}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part (the experts' gradients are DTensors over the ep group)."""
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _planned_row_exchanges(cfg, pcfg: ParallelConfig, shape, dtype: str) -> tuple[float, float]:
    """The planner's expert all-to-alls per micro-batch for this rank's layout and micro-batch: calls, bytes."""
    lay = Layout.from_parallel(pcfg, dist.get_world_size())
    work = Workload(seq_len=shape[1], micro_batch=shape[0], global_batch=shape[0] * lay.dp)
    colls = [c for c in stage_collectives(cfg, lay, work, 0, rank_params(cfg, lay)[0], get_precision("fp32"), dtype)
             if c.group == "ep" and c.op == "all-to-all"]
    return sum(c.calls_per_microbatch for c in colls), sum(c.calls_per_microbatch * c.size for c in colls)


@pytest.mark.dist
def test_kept_dispatch_in_fp8_moves_the_gradients_by_fp8_rounding_only():
    """`activation_fp8: [dispatch]`: the replay's expert rows and combined rows come from FP8 copies, so
    the expert weights' and router's gradients move by about FP8's rounding (3 mantissa bits), not more;
    the exchanges are those of the kept dispatch."""
    none = run_ranks(_step, 2, "none")
    fp8 = run_ranks(_step, 2, "kept-fp8")
    for got, want in zip(fp8, none, strict=True):
        assert got["calls"] == want["calls"]
        assert got["loss"] == want["loss"]
        moved = []
        for name, g in want["grads"].items():
            error = (got["grads"][name] - g).norm() / g.norm().clamp(min=1e-12)
            assert error < 0.1, (name, error)
            moved.append(error > 0)
        assert any(moved)  # the FP8 copies were used


@pytest.mark.dist
def test_kept_dispatch_sends_only_the_gradients_in_backward_with_the_same_gradients():
    runs = {policy: run_ranks(_step, 2, policy) for policy in ("none", "op", "kept")}
    for rank in range(2):
        none, op, kept = (runs[p][rank] for p in ("none", "op", "kept"))
        n = none["moe_layers"]
        assert n == 2
        # forward: the count exchange, the dispatch and the combine of every MoE layer, under any policy
        assert none["calls"]["forward"] == op["calls"]["forward"] == kept["calls"]["forward"] == 3 * n
        # backward: the gradients' two transposes; the plain op policy replays all three exchanges first
        assert none["calls"]["backward"] == 2 * n
        assert op["calls"]["backward"] == 5 * n
        assert kept["calls"]["backward"] == 2 * n
        # the planner's row exchanges are the trainer's: 4 per MoE layer kept or not recomputed, 6 replayed
        assert [r["planned"][0] for r in (none, op, kept)] == [r["row_calls"] for r in (none, op, kept)] \
            == [4 * n, 6 * n, 4 * n]
        assert kept["loss"] == none["loss"]
        assert set(kept["grads"]) == set(none["grads"])
        for name, g in none["grads"].items():
            torch.testing.assert_close(kept["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
            torch.testing.assert_close(op["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.dist
@pytest.mark.parametrize("dtype, policy", [("fp32", "kept"), ("autocast-bf16", "kept"), ("fp32", "kept-fp8")])
def test_the_kept_rows_are_the_bytes_the_planner_counts(dtype, policy):
    """What `dispatch` adds to the op policy's keep, summed over the ranks (each receives what its
    routing sends it; together they receive the k rows of every token), equals the planner's
    `kept_exchanges` (balanced rows) on every rank; in FP8, one byte per element and a scale per row."""
    autocast = dtype != "fp32"
    op = run_ranks(_step, 2, "op", autocast)
    kept = run_ranks(_step, 2, policy, autocast)
    cfg = get_preset("tiny-moe")
    tokens = kept[0]["tokens"]
    fp8 = policy == "kept-fp8"
    planned = sum(t.nbytes(tokens) for t in kept_exchanges(cfg, dtype, tokens, fp8))  # per MoE layer and rank
    assert planned > 0
    assert sum(k["kept_bytes"] - o["kept_bytes"] for k, o in zip(kept, op, strict=True)) == \
        2 * kept[0]["moe_layers"] * planned
    # the stage estimate's per-layer terms carry it under ep > 1 (layer 0 is a MoE layer)
    lay = Layout(dp_shard=2, ep=2, recompute="op", recompute_save=POLICIES[policy]["recompute_save"],
                 activation_fp8=POLICIES[policy].get("activation_fp8", ()))
    work = Workload(seq_len=tokens, micro_batch=1, global_batch=2)
    plain = dataclasses.replace(lay, recompute_save=DEEPSEEK, activation_fp8=())
    assert sum(t.nbytes(tokens) for t in layer_terms(cfg, 0, lay, work, dtype)) - sum(
        t.nbytes(tokens) for t in layer_terms(cfg, 0, plain, work, dtype)) == planned


@pytest.mark.dist
def test_the_planned_exchange_bytes_are_the_trainers_under_autocast():
    """Under autocast the dispatch sends the MoE input's fp32 rows and the combine the experts' bf16
    outputs (and their gradients alike): the planner's bytes, summed over the ranks (each receives what
    the routing sends it), are the traced ones."""
    for policy in ("none", "kept"):
        ranks = run_ranks(_step, 2, policy, True)
        assert sum(r["row_bytes"] for r in ranks) == sum(r["planned"][1] for r in ranks), policy


@pytest.mark.dist
def test_the_dispatch_in_the_compute_dtype_sends_half_the_bytes_and_rounds_only_the_rows_gradient():
    """`parallel.ep_dispatch_dtype: compute` under bf16 autocast: the dispatched rows cross in bf16, which
    the experts' products cast them to anyway, so the loss is the same to the bit; their gradient crosses
    in bf16 too (rounded once): gradients within bf16 rounding of the fp32 dispatch. The planner's bytes
    and kept memory are the traced and counted ones."""
    fp32 = run_ranks(_step, 2, "none", True)
    bf16 = run_ranks(_step, 2, "compute", True)
    for got, want in zip(bf16, fp32, strict=True):
        assert got["loss"] == want["loss"]
        assert got["calls"] == want["calls"]
        for name, g in want["grads"].items():
            error = (got["grads"][name] - g).norm() / g.norm().clamp(min=1e-12)
            assert error < 2e-2, (name, error)
    assert sum(r["row_bytes"] for r in bf16) < sum(r["row_bytes"] for r in fp32)
    assert sum(r["row_bytes"] for r in bf16) == sum(r["planned"][1] for r in bf16)
    kept, op = run_ranks(_step, 2, "kept-compute", True), run_ranks(_step, 2, "op", True)
    assert sum(r["row_bytes"] for r in kept) == sum(r["planned"][1] for r in kept)
    cfg = get_preset("tiny-moe")
    tokens = kept[0]["tokens"]
    planned = sum(t.nbytes(tokens) for t in kept_exchanges(cfg, "autocast-bf16", tokens, dispatch_dtype="compute"))
    assert sum(k["kept_bytes"] - o["kept_bytes"] for k, o in zip(kept, op, strict=True)) == \
        2 * kept[0]["moe_layers"] * planned


def test_a_replay_that_routes_differently_is_refused():
    record = ExchangeRecord()
    with Keeping(record, replay=False):
        received = exchange_counts(torch.tensor([2, 1]), lambda c: c.flip(0))
    assert received.tolist() == [1, 2]
    with Keeping(record, replay=True), pytest.raises(ParallelError, match="routed differently"):
        exchange_counts(torch.tensor([3, 0]), lambda c: pytest.fail("the replay sent"))
    for _ in range(2):  # every replay (one per pass of a split backward) starts from the first exchange
        with Keeping(record, replay=True):
            assert exchange_counts(torch.tensor([2, 1]), lambda c: pytest.fail("the replay sent")).tolist() == [1, 2]
            with pytest.raises(ParallelError, match="exchanged more than its forward"):
                exchange_counts(torch.tensor([2, 1]), lambda c: c)


def _pipeline_step(policy: str) -> dict:
    """One step of DualPipeV (pp2 x ep2, the pairs overlapped: forwards on a worker thread, replays on
    the caller's) alone; every all-to-all counted by the thread that sends it."""
    pcfg = ParallelConfig(pp=2, dp_shard=2, ep=2, pp_schedule="dualpipev", optimizer="distributed",
                          **POLICIES[policy])
    cfg = get_preset("tiny-moe", n_layers=4)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    batch = global_batch(cfg.vocab_size, rows=8)
    n_tokens = batch[:, 1:].numel()
    run = build_pipeline(Transformer(cfg, init_seed=SEED), dims, pcfg, 4,
                         loss_fn=lambda logits, targets: token_loss_sum(logits, targets) / n_tokens,
                         aux_scale=1.0 / 8, parallelize_stage=lambda m: parallelize(m, dims, pcfg))
    calls, real = {"caller": 0, "worker": 0}, dist.all_to_all_single

    def traced(*args, **kwargs):
        calls["caller" if threading.current_thread() is threading.main_thread() else "worker"] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = traced
    try:
        rows = shard_global_batch(batch, dims)
        losses = run.step(rows[:, :-1], rows[:, 1:])
    finally:
        dist.all_to_all_single = real
    return {"losses": [float(x.detach()) for x in losses], "calls": calls, "overlapped": run.overlapped is not None,
            "grads": {n: p.grad.detach().clone() for n, p in run.named_parameters()}}


@pytest.mark.dist
def test_kept_dispatch_under_dualpipev_overlap_replays_on_the_other_thread_without_sending():
    none, kept, op = (run_ranks(_pipeline_step, 4, p) for p in ("none", "kept", "op"))
    for k, n, o in zip(kept, none, op, strict=True):
        assert k["overlapped"] and n["overlapped"]
        assert k["losses"] == pytest.approx(n["losses"], rel=1e-6)
        for name, g in n["grads"].items():
            torch.testing.assert_close(k["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
            # the split backward (input pass, then weight pass) replays a block twice: both policies allow it
            torch.testing.assert_close(o["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
        # the same exchanges as keeping everything; the op policy's replays send more
        assert k["calls"] == n["calls"], (k["calls"], n["calls"])
        assert sum(o["calls"].values()) > sum(n["calls"].values())


@pytest.mark.dist
def test_deepseek_v3s_policy_trains_through_the_trainer_like_keeping_everything(small_dataset, tmp_path):
    """configs/deepseek-v3.yaml's memory and dispatch policy (op keeping the core, latents, router, SwiGLU
    inputs and the dispatch, the last two in FP8, the dispatch in bf16) on its schedule (DualPipeV, pairs
    overlapped) under its bf16 autocast, pp2 x ep2 through the real Trainer: the first loss equal to
    keeping everything (the forward is the same), gradient norms and the next loss within FP8 / bf16
    rounding of the backward."""
    recipe = {"parallel.recompute": "op", "parallel.recompute_save": "[" + ",".join((*DEEPSEEK, "dispatch")) + "]",
              "parallel.activation_fp8": "[mlp_in,dispatch]", "parallel.ep_dispatch_dtype": "compute"}

    def run(name: str, **extra) -> list[dict]:
        overrides = overrides_for("moe", small_dataset, tmp_path / name, 2, **PIPELINE_LAYOUT, **extra,
                                  **{"parallel.pp_schedule": "dualpipev", "train.dtype": "bf16"})
        return run_ranks(train_on_ranks, 4, "moe", overrides)[0]["records"]

    got, want = run("recipe", **recipe), run("plain")
    assert got[0]["loss"] == want[0]["loss"]
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-4)
    for g, w in zip(got, want, strict=True):
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)

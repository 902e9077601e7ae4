"""`tessera train --profile A:B` splits the recorded steps' compute by kind (attention, mlp, norm, loss,
other, optimizer) with module hooks that live only for the window: a model whose MLP is made heavy
(a feed-forward 64x its width) shows mlp as the largest kind; the kinds' intervals never overlap, so
they add up to no more than the measured compute; no hook is left on the model after the window.
`--profile-torch` writes torch.profiler's trace of the window as parsable Chrome-trace JSON."""

from __future__ import annotations

import json

import pytest
from torch import nn

from tessera.cli import main
from tessera.config.schema import load_config
from tessera.plan.cluster import Cluster
from tessera.plan.estimate import make_plan
from tessera.plan.layout import Layout, Workload
from tessera.plan.op_time import layer_ops
from tessera.profiling.planned_kinds import planned_kinds
from tessera.profiling.training import analyse
from tessera.train.run.module_marks import kind_of
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, set_args, shrink

HEAVY_MLP = {"model.ffn_dim": 4096, "checkpoint.interval": 0,  # dim 64: the MLP is ~32x attention's weights
             "train.eval_interval": 1, "train.eval_steps": 1}  # an evaluation's forward in each recorded step


def _module_events(run_dir) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "profile" / "rank0.jsonl").read_text().splitlines()]
    return [line for line in lines[1:] if line["kind"] == "module"]


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in module.modules())


def test_a_heavy_mlp_is_the_largest_kind_and_the_kinds_fit_in_compute(small_dataset, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, run, 3, **HEAVY_MLP)), profile=(2, 3))
    trainer.train()
    assert all(_hooks(part) == 0 for part in trainer.engine.parts)  # removed after the window
    events = _module_events(run)
    assert {e["step"] for e in events} == {2, 3}  # the window only
    assert {(e["name"], e["phase"]) for e in events} >= {
        (k, p) for k in ("attention", "mlp", "norm") for p in ("forward", "backward")} | {("loss", "forward")}
    spans = sorted((e["t0"], e["t1"]) for e in events)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # nested modules counted once
    lines = [json.loads(line) for line in (run / "profile" / "rank0.jsonl").read_text().splitlines()[1:]]
    ends = {e["step"]: e["t1"] for e in lines if e["kind"] == "region"}  # the step engine's forward/backward
    assert any(e["t0"] >= ends[e["step"]] for e in events)  # the evaluation's forward: timed, not compute
    report = analyse(run)
    kinds = {k: v["measured_s"] for k, v in report["compute_by_kind"].items()}
    planned = {k: v["planned_s"] for k, v in report["compute_by_kind"].items()}
    assert planned["norm"] is None and planned["other"] is None  # the planner folds them into elementwise work
    assert planned["mlp"] > planned["attention"] > 0 and planned["loss"] > 0
    assert planned["attention"] + planned["mlp"] + planned["loss"] <= report["terms"]["compute"]["planned_s"]
    assert list(kinds) == ["attention", "mlp", "norm", "loss", "other", "optimizer"]
    assert max(("attention", "mlp", "norm", "loss"), key=kinds.__getitem__) == "mlp"
    compute = report["terms"]["compute"]["measured_s"]
    assert sum(kinds[k] for k in ("attention", "mlp", "norm", "loss")) <= compute + 1e-9
    assert sum(kinds[k] for k in ("attention", "mlp", "norm", "loss", "other")) == pytest.approx(compute)
    assert kinds["optimizer"] == pytest.approx(report["terms"]["optimizer"]["measured_s"])


@pytest.mark.parametrize("ffn_dim", [128, 4096])
def test_the_planned_kinds_and_the_elementwise_work_are_the_plans_compute(ffn_dim):
    """No recomputation, one stage: attention + mlp + loss + 3 x each layer's elementwise term is the
    plan's compute exactly (op_time.stage_compute_time, micro-batch by micro-batch)."""
    cfg = load_config(TINY_DENSE, [f"model.ffn_dim={ffn_dim}"])
    cluster, lay, work = Cluster.for_gpu("h100", gpus=1, gpus_per_node=1), Layout.from_parallel(cfg.parallel, 1), \
        Workload(32, 2, 8)
    plan = make_plan(cfg.model, lay, work, cluster, activation_dtype="fp32")
    kinds = planned_kinds(cfg.model, lay, work, cluster, "fp32")
    ops = layer_ops(cfg.model, False, lay, 64, 32, cluster, "fp32")  # one micro-batch: 2 x 32 tokens
    elementwise = sum(o.seconds for o in ops if o.kind == "memory")
    total = sum(kinds.values()) + lay.microbatches(work) * cfg.model.n_layers * 3 * elementwise
    assert total == pytest.approx(plan.time.compute, rel=1e-9)


@pytest.mark.parametrize(("name", "module", "kind"), [
    ("layers.0.attention", nn.Identity(), "attention"), ("layers.0.attention.q_norm", nn.LayerNorm(4), "norm"),
    ("layers.1.feed_forward", nn.Identity(), "mlp"), ("layers.1.moe", nn.Identity(), "mlp"),
    ("output", nn.Linear(2, 2), "loss"), ("tok_embeddings", nn.Embedding(2, 2), None),
    ("layers.0", nn.Identity(), None)])
def test_module_kinds_by_name_and_class(name, module, kind):
    assert kind_of(name, module) == kind


def test_profile_torch_writes_a_chrome_trace_of_the_window(small_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, run, 2, **{"checkpoint.interval": 0})),
                 "--profile", "2:2", "--profile-torch"]) == 0
    trace = json.loads((run / "profile" / "torch_rank0.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names)  # the window's operators
    capsys.readouterr()
    assert main(["profile", str(run)]) == 0
    assert "compute by kind: attention" in capsys.readouterr().out
    merged = json.loads((run / "profile" / "trace.json").read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in merged if e.get("name") == "thread_name"}
    assert {threads[e["tid"]] for e in merged if e.get("cat") == "module"} == {"module"}  # the kinds, a lane apart


def test_profile_torch_without_a_window_is_refused(capsys):
    assert main(["train", TINY_DENSE, "--profile-torch"]) == 2
    assert "--profile-torch is invalid without --profile A:B" in capsys.readouterr().err

"""The real Trainer on forked ranks, and the one-process run it must equal.

`train_on_ranks` is what each rank runs: build the Trainer from the config and overrides, train,
and return the logged records (rank 0) and this rank's parameters gathered whole. Equality tests
use AdamW eps = 1e-3 (EQUALITY_OVERRIDES): with the default 1e-8, Adam's first update is about
lr * sign(g), which turns rounding noise in gradients that are ~0 into lr-sized differences
between layouts and would hide what the tests are about; with a large eps the update stays
proportional to the gradient.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from tessera.config.schema import load_config
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DEEPSEEK, TINY_DENSE, TINY_MOE, deepseek_shrink, moe_shrink, shrink

EQUALITY_OVERRIDES = {"optim.eps": 1e-3, "checkpoint.interval": 0}
MODELS = {"dense": (TINY_DENSE, shrink), "moe": (TINY_MOE, moe_shrink),
          "deepseek": (TINY_DEEPSEEK, deepseek_shrink)}


def overrides_for(model: str, dataset: str, run_dir: Path | str, steps: int, **extra: object) -> list[str]:
    config, shrink_fn = MODELS[model]
    return shrink_fn(dataset, run_dir, steps, **{**EQUALITY_OVERRIDES, **extra})


def whole_parameters(modules) -> dict[str, torch.Tensor]:
    """Every parameter of `modules` gathered whole (a collective for DTensors: all ranks call it)."""
    out = {}
    for m in modules:
        for name, p in m.named_parameters():
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def train_on_ranks(model: str, overrides: list[str], resume: bool = False) -> dict:
    """Runs on every rank: train through the real Trainer; records (rank 0) and whole weights."""
    trainer = Trainer(load_config(MODELS[model][0], overrides), resume=resume)
    result = trainer.train()
    return {"records": result.records, "weights": whole_parameters(trainer.parts),
            "start_step": result.start_step}


def train_one_process(model: str, overrides: list[str], resume: bool = False) -> dict:
    trainer = Trainer(load_config(MODELS[model][0], overrides), resume=resume)
    result = trainer.train()
    return {"records": result.records, "weights": whole_parameters(trainer.parts),
            "start_step": result.start_step}


def merged_weights(results: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model from every rank's part (pipeline stages hold different parameters)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["weights"])
    return out


def assert_merged_weights_equal(results: list[dict], want: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    """The ranks' parts together are exactly `want`'s parameters, each equal to it within `tol`."""
    weights = merged_weights(results)
    assert set(weights) == set(want)
    for name, value in weights.items():
        torch.testing.assert_close(value, want[name], rtol=tol, atol=tol, msg=name)


def assert_frozen_parts_untouched(trainer, before: dict[str, torch.Tensor], frozen) -> None:
    """After `trainer.train()`: each parameter `frozen(name, p)` names is bit-identical to `before`,
    has no gradient, does not require one and has no optimizer state; every other one has moved."""
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    for name, p in trainer.model.named_parameters():
        if frozen(name, p):
            assert torch.equal(p, before[name]), name
            assert p.grad is None and not p.requires_grad and id(p) not in optimized, name
            assert p not in trainer.optimizer.state, name
        else:
            assert not torch.equal(p, before[name]), name


def assert_same_training(got: list[dict], ref: dict, rtol: float) -> None:
    """Logged losses (and MoE aux losses) and final weights of a layout equal the one-process run."""
    records, want = got[0]["records"], ref["records"]
    assert [r["step"] for r in records] == [r["step"] for r in want]
    for r, w in zip(records, want):
        assert abs(r["loss"] - w["loss"]) <= rtol * abs(w["loss"]), (r["step"], r["loss"], w["loss"])
        # The one-process trainer keeps torch.nn.utils.clip_grad_norm_, whose fp32 norm of the
        # 262k-entry embedding gradient is ~3e-5 off the fp64 value; the layouts' norm
        # (tessera.parallel.grad_norm) is within 1e-7 of it. Hence the looser bound here only.
        norm_rtol = max(1e-4, rtol)
        assert abs(r["grad_norm"] - w["grad_norm"]) <= norm_rtol * w["grad_norm"], (r["grad_norm"], w["grad_norm"])
        if "aux_loss" in w:
            assert abs(r["aux_loss"] - w["aux_loss"]) <= rtol * abs(w["aux_loss"]) + 1e-9
            loads = [k for k in w if k.startswith("expert_load/") and k.endswith("/mean_tokens")]
            assert loads and all(r[k] == w[k] for k in loads)
    assert all(not r["records"] for r in got[1:])  # only rank 0 logs
    weights = merged_weights(got)
    assert set(weights) == set(ref["weights"])
    for name, w in ref["weights"].items():
        err = float((weights[name] - w).norm() / w.norm().clamp_min(1e-30))
        assert err <= rtol, f"{name} differs by {err:.2e} (relative norm)"

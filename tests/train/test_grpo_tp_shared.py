"""GRPO under tensor parallelism with the engine's shards aliasing the trainer's
(tessera/infer/runner/tp_shared.py, tessera/eval/rollouts.py): on two forked gloo ranks (tp=2) the
serving model's every parameter is the same storage (data_ptr) as the policy's local shard, before
and after the optimizer steps, so no copy exists; the steps moved the weights, and the engine the
tp group drives over those shards decodes with them: its logits equal the trainer's (fp32 1e-5) and
differ from the initial weights', and its greedy completions equal those of a one-process engine
built on the gathered updated weights. The same holds for an MoE policy, whose routed experts are cut on
their hidden dim over tp. The tp group samples every prompt with one engine (rank 0 drives it, its
peer serves the same steps); a rollout that fails on rank 0, or a failure building the engine there
(its weights at bind, its executor, the engine around it), stops the peer at once with the reason
instead of leaving it waiting. Under dp_shard and tp the engine holds a tp shard gathered over
dp_shard, under dp_shard alone a whole gathered copy (tests/train/test_grpo_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tessera.config.schema import load_config
from tessera.eval.rollouts import EngineRollouts, _generate
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.runner.tp_shared import serve_group_steps
from tessera.models.model_input import ModelInput
from tessera.models.transformer import Transformer
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.train.runs import TINY_DENSE, TINY_MOE
from tests.train.test_grpo_train import _engine_logits, _overrides, grpo_root

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return grpo_root(tmp_path_factory)


def on_group(rollouts: EngineRollouts, sequences: int, fn):
    """fn(engine) on the tp group's rank 0, with an engine over the group's shards (its peers serve
    the steps meanwhile); fn's result there, None on the peers."""
    if dist.get_rank(rollouts.tp_group) == 0:
        engine = rollouts.engine(sequences)
        try:
            return fn(engine)
        finally:
            engine.close()
    serve_group_steps(rollouts.model, rollouts.config(sequences), rollouts.tp_group)
    return None


def _greedy(engine: LLMEngine) -> list[list[int]]:
    return [list(o.token_ids) for o in _generate(engine, PROMPTS, 1, 6, 0.0, [0, 1])]


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _aliased_run(overrides: list[str], config: str = TINY_DENSE) -> dict:
    cfg = load_config(config, overrides)
    rollouts = EngineRollouts(cfg)
    trainer = Trainer(cfg, rollouts=rollouts)
    policy = dict(trainer.model.named_parameters())
    served = dict(rollouts.model.named_parameters())
    initial = {n: _whole(p).clone() for n, p in policy.items()}
    ptrs_before = {n: served[n].data_ptr() == _local(p).data_ptr() for n, p in policy.items()}
    ids = trainer.data.train.next_batch().tokens[0, :20].tolist()
    before = on_group(rollouts, 1, lambda e: _engine_logits(e, ids))
    sampled = []
    sample = rollouts.rollouts

    def counted(prompts, *args):
        sampled.append(len(prompts))
        return sample(prompts, *args)
    rollouts.rollouts = counted
    trainer.train()
    ptrs_after = {n: served[n].data_ptr() == _local(p).data_ptr() for n, p in policy.items()}
    updated = {n: _whole(p).detach() for n, p in policy.items()}
    with torch.no_grad():
        want = trainer.model(ModelInput(tokens=torch.tensor([ids]))).logits[0].float()
    want = want.full_tensor() if isinstance(want, DTensor) else want
    got = on_group(rollouts, 1, lambda e: _engine_logits(e, ids))
    greedy = on_group(rollouts, len(PROMPTS), _greedy)
    out = {"spans_tp": rollouts.spans_tp, "ptrs_before": ptrs_before, "ptrs_after": ptrs_after,
           "moved": max(float((updated[n] - initial[n]).abs().max()) for n in updated), "sampled": sampled}
    if got is not None:  # rank 0: the one-process engine on the gathered weights, for the greedy tokens
        whole = Transformer(cfg.model).requires_grad_(False)
        whole.load_state_dict(updated, strict=False)
        one = rollouts_one_process(cfg, whole)
        out.update(engine_diff=float((got - want).abs().max()), engine_moved=float((got - before).abs().max()),
                   greedy=greedy, greedy_one=_greedy(one))
        one.close()
    return out


def rollouts_one_process(cfg, model: Transformer) -> LLMEngine:
    """An engine of one process around `model`, set as the rollouts' engine is."""
    single = EngineRollouts(cfg)
    single.model = model
    return single.engine(len(PROMPTS))


TINY_MOE_GRPO = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.ffn_dim": 64}


@pytest.mark.dist
@pytest.mark.parametrize("config,extra", [pytest.param(TINY_DENSE, {}, id="dense"),
                                          pytest.param(TINY_MOE, TINY_MOE_GRPO, id="moe")])
def test_under_tp_the_engine_shards_are_the_trainers_and_decode_the_updated_weights(root, config, extra):
    run = _overrides(root, f"tp-shared-{len(extra)}", steps=2, **{
        "optim.lr": 1e-2, "train.micro_batch_size": 1, "parallel.tp": 2, "parallel.dp_shard": 1, **extra})
    got = run_ranks(_aliased_run, 2, run, config, timeout=HANG_S)
    for rank in got:
        assert rank["spans_tp"]
        assert rank["ptrs_before"] and all(rank["ptrs_before"].values()), rank["ptrs_before"]
        assert all(rank["ptrs_after"].values()), rank["ptrs_after"]  # the optimizer updated them in place
        assert rank["moved"] > 1e-4
        assert rank["sampled"] == [4, 4]  # each step hands every tp rank all 4 prompts: one engine samples them
    lead = got[0]
    assert lead["engine_moved"] > 1e-4  # 10x the tolerance below: the engine sees the steps
    assert lead["engine_diff"] < 1e-5, lead["engine_diff"]
    assert lead["greedy"] == lead["greedy_one"] and all(lead["greedy"])


def _failing_run(overrides: list[str]) -> str:
    """Train, rank 0's engine failing its first rollout (a request error, as `_generate` raises it);
    what each rank's training raised."""
    import tessera.eval.rollouts as rollouts_module

    cfg = load_config(TINY_DENSE, overrides)
    trainer = Trainer(cfg, rollouts=EngineRollouts(cfg))
    if dist.get_rank() == 0:
        def failing(*args, **kwargs):
            raise RuntimeError("boom")
        rollouts_module._generate = failing  # this forked rank's module only
    try:
        trainer.train()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


@pytest.mark.dist
def test_a_rollout_that_fails_on_the_driving_rank_stops_its_tp_peer_with_the_reason(root):
    run = _overrides(root, "tp-shared-fail", steps=1, **{"parallel.tp": 2, "parallel.dp_shard": 1})
    driver, peer = run_ranks(_failing_run, 2, run, timeout=HANG_S)
    assert "boom" in driver
    assert peer == "TrainingError: the tp group's rank 0 failed its rollouts: boom"


def _failing_build(overrides: list[str], target: str, failing_rank: int = 0) -> str:
    """Train, `failing_rank` failing where `target` ("module:name") is called (as running out of memory
    would); what each rank's trainer raised, built or training."""
    import importlib

    module_name, _, name = target.partition(":")
    if dist.get_rank() == failing_rank:
        def failing(*args, **kwargs):
            raise RuntimeError("no memory left")
        setattr(importlib.import_module(module_name), name, failing)  # this forked rank's module only
    cfg = load_config(TINY_DENSE, overrides)
    try:
        Trainer(cfg, rollouts=EngineRollouts(cfg)).train()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "trained"


@pytest.mark.dist
@pytest.mark.parametrize("target,reason", [
    pytest.param("tessera.eval.rollouts:alias_shards",
                 "rank 0 failed to build the rollout engine's weights: RuntimeError: no memory left", id="weights"),
    pytest.param("tessera.infer.runner.tp_executor:build_paged_model",
                 "the tp group's rank 0 failed to build its engine: no memory left", id="executor"),
    pytest.param("tessera.infer.engine.llm_engine:engine_blocks",
                 "the tp group's rank 0 failed to build its engine: no memory left", id="engine")])
def test_a_failure_building_the_engine_on_rank_0_reaches_its_tp_peer_at_once(root, target, reason):
    run = _overrides(root, f"tp-build-fail-{target.rpartition(':')[2]}", steps=1,
                     **{"parallel.tp": 2, "parallel.dp_shard": 1})
    driver, peer = run_ranks(_failing_build, 2, run, target, timeout=HANG_S)  # a hang fails at HANG_S
    assert "no memory left" in driver
    assert peer == f"TrainingError: {reason}"


@pytest.mark.dist
def test_a_failure_building_the_engine_on_a_tp_peer_reaches_rank_0_at_once(root):
    """The peer's paged model (its KV cache) fails to build: rank 0, which built its engine, hears of it
    with the peer's reason before its first step, instead of stepping into a peer that never answers
    until the collective timeout."""
    run = _overrides(root, "tp-build-fail-peer", steps=1, **{"parallel.tp": 2, "parallel.dp_shard": 1})
    driver, peer = run_ranks(_failing_build, 2, run, "tessera.infer.runner.tp_shared:build_paged_model", 1,
                             timeout=HANG_S)  # a hang fails at HANG_S
    assert driver == "TrainingError: the tp group's rank 1 failed to build its engine: no memory left"
    assert peer == "RuntimeError: no memory left"

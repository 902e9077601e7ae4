"""`tessera train` with `train.eagle.target` (tessera/train/modes/eagle.py): an EAGLE-3 draft head
trained against a frozen target. A few steps lower the draft's loss, the target's weights stay as
they were, two data-parallel ranks train the one-process draft, other layouts are refused by name,
and the directory written is what `tessera serve --speculative eagle` serves: greedy output equal to
the target's alone, the acceptance counters on /metrics. A run stopped and resumed continues as the
uninterrupted one."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tests.hang_guard import HANG_S
from tests.train.runs import TINY_DENSE, shrink


@pytest.fixture(scope="module")
def target_run(small_dataset, tmp_path_factory) -> str:
    """A tiny dense target trained on real Python source until its next-token distribution is far
    from uniform (what a draft can be measured against)."""
    from tessera.train.trainer import Trainer

    run = tmp_path_factory.mktemp("target") / "run"
    Trainer(load_config(TINY_DENSE, shrink(small_dataset, run, 40, **{
        "model.n_layers": 4, "checkpoint.interval": 40, "optim.lr": 3e-3, "optim.total_steps": 40,
        "log.progress_bar": False}))).train()
    return str(run)


def _eagle_overrides(dataset: str, target: str, run_dir: Path, steps: int, **extra) -> list[str]:
    return shrink(dataset, run_dir, steps, **{"train.eagle.target": target, "train.eagle.unroll": 2,
                                              "optim.lr": 3e-3, "optim.warmup_steps": 0, **extra})


def _files_digest(run: str) -> str:
    h = hashlib.sha256()
    for f in sorted((Path(run) / "checkpoints").rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_training_lowers_the_draft_loss_and_leaves_the_target_as_it_was(small_dataset, target_run, tmp_path):
    from tessera.checkpoint.eagle_dir import load_eagle_draft
    from tessera.train.trainer import Trainer

    before = _files_digest(target_run)
    trainer = Trainer(load_config(TINY_DENSE, _eagle_overrides(small_dataset, target_run, tmp_path / "e", 12)))
    target_before = {k: v.clone() for k, v in trainer.engine.target.state_dict().items()}
    result = trainer.train()
    losses = [r["loss"] for r in result.records]
    assert len(losses) == 12 and all(k in result.records[0] for k in ("eagle_loss/0", "eagle_loss/1", "eagle_acc/0"))
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    # the cross-entropy's share above the target's entropy, which is all the draft can lower
    kl = [r["eagle_kl/0"] + r["eagle_kl/1"] for r in result.records]
    assert sum(kl[-3:]) < 0.6 * sum(kl[:3]), kl
    assert _files_digest(target_run) == before  # the target's checkpoint is untouched ...
    for k, v in trainer.engine.target.state_dict().items():  # ... and so is the target the run held
        torch.testing.assert_close(v, target_before[k], rtol=0, atol=0, msg=k)
    assert all(not p.requires_grad for p in trainer.engine.target.parameters())
    back = load_eagle_draft(result.written, trainer.cfg.model, torch.float32, "cpu")
    for (name, a), (_, b) in zip(trainer.engine.draft.state_dict().items(), back.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_reduced_draft_vocabulary_is_the_datas_most_frequent_tokens(small_dataset, target_run, tmp_path):
    """train.eagle.draft_vocab_size: the head predicts over the most frequent target tokens of the
    data, the directory maps them back (d2t), and the target served with it decodes as without it."""
    from tessera.checkpoint.eagle_dir import load_eagle_draft
    from tessera.config.training.eagle import VOCAB_SAMPLE_BATCHES
    from tessera.infer import LLM, SamplingParams, SpeculativeConfig
    from tessera.train.data_source import build_training_data
    from tessera.train.trainer import Trainer

    trainer = Trainer(load_config(TINY_DENSE, _eagle_overrides(small_dataset, target_run, tmp_path / "e", 3,
                                                                    **{"train.eagle.draft_vocab_size": 300})))
    result = trainer.train()
    batches = build_training_data(trainer.cfg).train
    V = trainer.cfg.model.vocab_size
    counts = sum(torch.bincount(batches.next_batch().tokens.reshape(-1), minlength=V)
                 for _ in range(VOCAB_SAMPLE_BATCHES))
    draft = load_eagle_draft(result.written, trainer.cfg.model, torch.float32, "cpu")
    chosen = torch.arange(300) + draft.d2t
    assert len(set(chosen.tolist())) == 300 and chosen.tolist() == sorted(chosen.tolist())
    others = torch.ones(V, dtype=torch.bool)
    others[chosen] = False
    assert counts[chosen].min() >= counts[others].max()
    prompts = ["def main(", "import os\n"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(target_run, block_size=4).generate(prompts, params)
    llm = LLM(target_run, block_size=4, speculative=SpeculativeConfig(method="eagle", num_tokens=3,
                                                                        draft_model=str(result.written)))
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.metrics.spec_proposed > 0


def _train_on_rank(overrides: list[str]) -> dict:
    from tessera.train.trainer import Trainer

    trainer = Trainer(load_config(TINY_DENSE, overrides))
    result = trainer.train()
    return {"records": result.records, "draft": {k: v.clone() for k, v in trainer.engine.draft.state_dict().items()}}


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["dp_shard", "dp_replicate"])
def test_two_data_parallel_ranks_train_the_one_process_draft(small_dataset, target_run, tmp_path, layout):
    from tests.forked_ranks import run_ranks

    ref = _train_on_rank(_eagle_overrides(small_dataset, target_run, tmp_path / "one", 3))
    dp = {"parallel.dp_shard": 2} if layout == "dp_shard" else {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}
    got = run_ranks(_train_on_rank, 2, _eagle_overrides(small_dataset, target_run, tmp_path / "two", 3, **dp),
                    timeout=HANG_S)
    assert len(got[0]["records"]) == 3
    for r, w in zip(got[0]["records"], ref["records"], strict=True):
        for key in ("loss", "grad_norm", "eagle_loss/0", "eagle_loss/1", "eagle_kl/1", "eagle_acc/0"):
            assert abs(r[key] - w[key]) <= 1e-5 * max(abs(w[key]), 1e-6), (key, r, w)
    for rank in got:
        for name, w in ref["draft"].items():
            torch.testing.assert_close(rank["draft"][name], w, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("key,value", [("parallel.tp", 2), ("parallel.pp", 2), ("parallel.cp", 2), ("parallel.ep", 2)])
def test_layouts_other_than_data_parallelism_are_refused_by_name(small_dataset, target_run, tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"{key}={value} is invalid: 1 with train.eagle.target"):
        load_config(TINY_DENSE, _eagle_overrides(small_dataset, target_run, tmp_path / "e", 2, **{key: value}))


def test_a_missing_target_is_refused(small_dataset, tmp_path):
    from tessera.train.trainer import Trainer

    with pytest.raises(ConfigError, match="train.eagle.target='/nowhere' is invalid: no such directory"):
        Trainer(load_config(TINY_DENSE, _eagle_overrides(small_dataset, "/nowhere", tmp_path / "e", 2)))


def _train_draft(overrides: list[str], resume: bool = False) -> dict:
    from tessera.train.trainer import Trainer

    trainer = Trainer(load_config(TINY_DENSE, overrides), resume=resume)
    result = trainer.train()
    return {"records": result.records, "start_step": result.start_step, "resumed_from": trainer.resumed_from,
            "draft": {k: v.clone() for k, v in trainer.engine.draft.state_dict().items()},
            "optim": trainer.optimizer.state_dict()}


def _read_records(run: Path) -> dict[int, dict]:
    import json

    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_stop_and_resume_continues_the_draft_bit_for_bit(small_dataset, target_run, tmp_path):
    """Six steps straight against three, then --resume to six (checkpoints every 2 steps and at the
    end): the same losses, gradient norms and accuracies step for step, one metrics line per step,
    and the same final draft and AdamW state, bit for bit (fp32 on CPU)."""
    full = _train_draft(_eagle_overrides(small_dataset, target_run, tmp_path / "full", 6))
    first = _train_draft(_eagle_overrides(small_dataset, target_run, tmp_path / "split", 3))
    assert first["resumed_from"] is None
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("step_*")) == \
        ["step_00000002", "step_00000003"]
    second = _train_draft(_eagle_overrides(small_dataset, target_run, tmp_path / "split", 6), resume=True)
    assert second["resumed_from"].name == "step_00000003" and second["start_step"] == 3
    got, want = _read_records(tmp_path / "split"), _read_records(tmp_path / "full")
    assert sorted(got) == list(range(1, 7))
    for step in range(1, 7):
        for key in ("loss", "grad_norm", "lr", "eagle_loss/0", "eagle_loss/1", "eagle_acc/1"):
            assert got[step][key] == want[step][key], (step, key)
    for name, w in full["draft"].items():
        assert torch.equal(second["draft"][name], w), name
    for i, w in full["optim"]["state"].items():
        for key, value in w.items():
            assert torch.equal(second["optim"]["state"][i][key], value), (i, key)
    # without --resume a run directory that holds checkpoints is refused, as for any run
    with pytest.raises(ConfigError, match="already holds checkpoints; pass --resume"):
        _train_draft(_eagle_overrides(small_dataset, target_run, tmp_path / "split", 8))


@pytest.mark.dist
def test_a_two_rank_run_resumes_in_one_process_like_the_straight_run(small_dataset, target_run, tmp_path):
    """Checkpoints written by two data-parallel ranks (the draft replicated) resume in one process:
    the resumed steps equal the one-process straight run's (fp32 within 1e-5)."""
    from tests.forked_ranks import run_ranks

    full = _train_draft(_eagle_overrides(small_dataset, target_run, tmp_path / "full", 4))
    run_ranks(_train_draft, 2, _eagle_overrides(small_dataset, target_run, tmp_path / "split", 2,
                                                **{"parallel.dp_shard": 2}), timeout=HANG_S)
    second = _train_draft(_eagle_overrides(small_dataset, target_run, tmp_path / "split", 4), resume=True)
    assert second["start_step"] == 2
    got, want = _read_records(tmp_path / "split"), _read_records(tmp_path / "full")
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("loss", "grad_norm", "eagle_loss/1"):
            assert abs(got[step][key] - want[step][key]) <= 1e-5 * abs(want[step][key]), (step, key)
    for name, w in full["draft"].items():
        torch.testing.assert_close(second["draft"][name], w, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_the_cli_trains_a_draft_that_serves_over_http(small_dataset, target_run, tmp_path, capsys):
    """`tessera train ... --set train.eagle.target=RUN` writes run_dir/draft; served with
    `--speculative eagle` the target answers as without speculation and /metrics counts drafts."""
    import httpx

    from tessera.cli import main
    from tessera.infer import EngineConfig, LLMEngine
    from tests.infer.running_server import RunningServer

    run = tmp_path / "eagle"
    overrides = _eagle_overrides(small_dataset, target_run, run, 8)
    argv = ["train", TINY_DENSE] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"--speculative eagle --draft-model {run / 'draft'}" in out
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 16, "temperature": 0.0}
    with RunningServer(LLMEngine.from_dir(target_run, EngineConfig(block_size=4)), name="tiny") as s:
        want = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S).json()["choices"][0]["text"]
    spec = {"method": "eagle", "num_tokens": 3, "draft_model": str(run / "draft")}
    with RunningServer(LLMEngine.from_dir(target_run, EngineConfig(block_size=4, speculative=spec)), name="tiny") as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        text = httpx.get(s.url + "/metrics").text
    proposed = [ln for ln in text.splitlines() if ln.startswith("tessera_spec_proposed_tokens_total")]
    assert proposed and float(proposed[0].split()[-1]) > 0
    assert "# TYPE tessera_spec_acceptance_rate" in text

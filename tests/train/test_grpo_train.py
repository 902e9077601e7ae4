"""`train.objective=grpo` (tessera/train/modes/grpo.py, rollouts by the serving engine in
tessera/eval/rollouts.py): one step's loss, figures and gradients on fixed rollouts equal a
hand-written reference (token- and sequence-level averaging, temperature, TIS weights, k3 KL to the
initial weights, entropy); after an optimizer step the engine's logits equal the trainer's (fp32
1e-5) with no copy in one process, and from a copy gathered over dp_shard (this rank's tp shard
under tp, else the whole model), where forked ranks train the one-process policy, dense or MoE;
the engine's KV cache is released after each rollout phase; a group's later completions reuse the
prefix blocks of its first one's prefill and sample the tokens adding them all at once samples; a
tiny seeded task (a completion that starts with a digit) raises its mean reward by a set margin
within a fixed budget of steps through `tessera train`, every step logging the GRPO metrics; bad
input (a prompt longer than the context, a reward that raises or returns NaN, a reward module that
does not exist, group_size 1) is refused in one line or counted, as issue 48 asks."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.cli import main
from tessera.config.errors import ConfigError, DataError
from tessera.config.schema import load_config
from tessera.eval.rollouts import EngineRollouts, _generate
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.sequence import Sequence
from tessera.infer.runner.paged_model import BatchItem
from tessera.infer.sampling.params import SamplingParams
from tessera.models.model_input import ModelInput
from tessera.train.modes.grpo import Rollouts
from tessera.train.modes.registry import training_mode
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.hang_guard import HANG_S
from tests.infer.tiny_models import save_tokenizer
from tests.parallel.trainer_runs import whole_parameters
from tests.train.runs import TINY_DENSE, TINY_MOE, set_args

KEYS = ("reward_mean", "reward_std", "kl", "clip_fraction", "response_length", "logprob_diff_max",
        "logprob_diff_mean", "rollout_tokens_per_s")
WORDS = ["cat", "dog", "sun", "map", "red", "box", "cup", "pen"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return grpo_root(tmp_path_factory)


def grpo_root(tmp_path_factory) -> Path:
    """A character-level tokenizer (128 ids, a digit is ~8% of a random model's tokens) and eight prompts."""
    root = tmp_path_factory.mktemp("grpo")
    save_tokenizer(root / "tok")
    records = [{"prompt": f"Say a number after {w}", "answer": i} for i, w in enumerate(WORDS)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def _overrides(root: Path, run: str, steps: int = 2, **extra: object) -> list[str]:
    values: dict[str, object] = {
        "run_dir": root / run, "train.device": "cpu", "data.tokenizer": root / "tok", "model.vocab_size": 128,
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128,
        "model.max_seq_len": 64, "train.seq_len": 48, "train.micro_batch_size": 2, "train.global_batch_size": 4,
        "train.steps": steps, "train.log_interval": 1, "train.eval_interval": 0, "optim.warmup_steps": 0,
        "optim.schedule": "constant", "checkpoint.interval": 0, "log.tensorboard": "false",
        "log.progress_bar": "false", "data.kind": "prompts", "train.objective": "grpo",
        "data.datasets": f"[{{path: {root / 'prompts.jsonl'}}}]", "train.grpo.reward": "regex_format",
        "train.grpo.format_pattern": r"'\d.*'", "train.grpo.max_new_tokens": 4}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class FixedRollouts:
    """Rollouts fixed in advance (what a hand computation can be checked on): each completion's
    tokens, the engine's log-probabilities of them and its reward follow from its index alone."""

    def __init__(self, group_size: int):
        self.group_size, self.seen = group_size, []

    def bind(self, model, layout) -> None:
        self.model = model

    def rollouts(self, prompts, records, seeds) -> Rollouts:
        self.seen.append(prompts)
        n = len(prompts) * self.group_size
        completions = [[(7 * k + 3 * t) % 120 + 3 for t in range(1 + (3 * k) % 5)] for k in range(n)]
        engine = [[-5.2 + 0.15 * ((k + t) % 7) for t in range(len(c))] for k, c in enumerate(completions)]
        rewards = [float((3 * k) % 4) / 2 for k in range(n)]
        return Rollouts(completions, engine, rewards, reward_failures=0, seconds=1.0)


def _hand_advantages(rewards: list[float], group: int) -> list[float]:
    out = []
    for g in range(0, len(rewards), group):
        rs = rewards[g:g + group]
        mean = sum(rs) / group
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (group - 1))
        out += [(r - mean) / (std + 1e-4) for r in rs]
    return out


def _hand_objective(policy, initial, prompts, ro: Rollouts, g, averaging: str, old=None):
    """The GRPO objective of the rollouts, token by token, written out (its value carries the gradient).
    `old`: the policy that the rollouts' ratio is taken against (None: `policy` itself, ratio 1)."""
    advantages = _hand_advantages(ro.rewards, g.group_size)
    terms, figures = [], {"kl": 0.0, "diff": 0.0, "tokens": 0, "clipped": 0}
    for k, completion in enumerate(ro.completions):
        seq = prompts[k // g.group_size] + completion
        x = torch.tensor([seq[:-1]])
        logits = policy(ModelInput(tokens=x)).logits[0].float()
        with torch.no_grad():
            ref_logits = initial(ModelInput(tokens=x)).logits[0].float()
            old_logits = logits.detach() if old is None else old(ModelInput(tokens=x)).logits[0].float()
        seq_terms = []
        for t, token in enumerate(completion):
            pos = len(seq) - len(completion) - 1 + t
            logp = torch.log_softmax(logits[pos] / g.temperature, -1)[token]
            old_logp = torch.log_softmax(old_logits[pos] / g.temperature, -1)[token]
            raw = torch.log_softmax(old_logits[pos], -1)[token].item()  # the sampling policy's
            ref = torch.log_softmax(ref_logits[pos] / g.temperature, -1)[token].item()
            probs = torch.softmax(logits[pos] / g.temperature, -1)
            entropy = -(probs * probs.log()).sum()
            weight = min(math.exp(raw - ro.engine_logps[k][t]), g.tis_cap)
            ratio = torch.exp(logp - old_logp)  # 1 with old None, with the policy's gradient
            a = advantages[k]
            clipped = (ratio.item() > 1 + g.clip_high and a > 0) or (ratio.item() < 1 - g.clip_low and a < 0)
            surrogate = torch.minimum(ratio * a, ratio.clamp(1 - g.clip_low, 1 + g.clip_high) * a)
            k3 = torch.exp(ref - logp) - (ref - logp) - 1
            seq_terms.append(-surrogate * weight + g.kl_coef * k3 - g.entropy_coef * entropy)
            figures["kl"] += k3.item()
            figures["diff"] += abs(raw - ro.engine_logps[k][t])
            figures["tokens"] += 1
            figures["clipped"] += clipped
        terms.append(torch.stack(seq_terms))
    if averaging == "token":
        return torch.cat(terms).sum() / figures["tokens"], figures
    return sum(t.mean() for t in terms) / len(terms), figures


@pytest.mark.parametrize("averaging", ["token", "sequence"])
def test_one_step_loss_figures_and_gradients_equal_a_hand_written_reference(root, averaging):
    cfg = load_config(TINY_DENSE, _overrides(root, f"hand-{averaging}", **{
        "train.grpo.loss_averaging": averaging, "train.grpo.temperature": 0.7, "train.grpo.kl_coef": 0.1,
        "train.grpo.entropy_coef": 0.01, "train.grpo.tis_cap": 1.5, "train.grpo.group_size": 2}))
    rollouts = FixedRollouts(2)
    trainer = Trainer(cfg, rollouts=rollouts)
    assert rollouts.model is trainer.model
    initial = copy.deepcopy(trainer.model)
    with torch.no_grad():  # the policy moved off its reference, as after some steps: the KL is not 0
        generator = torch.Generator().manual_seed(5)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    policy = copy.deepcopy(trainer.model)
    batch = trainer.data.train.next_batch()
    result = trainer.engine.forward_backward(batch)

    prompts = rollouts.seen[0]
    assert prompts == [row[mask].tolist() for row, mask in zip(batch.tokens, batch.loss_mask)]
    ro = rollouts.rollouts(prompts, [], [])
    want, figures = _hand_objective(policy, initial, prompts, ro, cfg.train.grpo, averaging)
    want.backward()
    assert result.loss == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    s = result.scalars
    assert s["reward_mean"] == pytest.approx(sum(ro.rewards) / len(ro.rewards), abs=1e-9)
    assert s["response_length"] == pytest.approx(figures["tokens"] / len(ro.completions))
    assert s["kl"] == pytest.approx(figures["kl"] / figures["tokens"], rel=1e-5) and s["kl"] > 1e-4
    assert s["logprob_diff_mean"] == pytest.approx(figures["diff"] / figures["tokens"], rel=1e-5)
    assert s["clip_fraction"] == 0 and result.loss_tokens == figures["tokens"]
    grads = dict(policy.named_parameters())
    for name, p in trainer.model.named_parameters():
        g = grads[name].grad
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def _engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """The logits of every position of `ids` through the engine's paged path (its KV cache)."""
    seq = Sequence("probe", ids, SamplingParams(), None)
    assert engine.blocks.ensure_slots(seq, len(ids))
    try:
        with torch.inference_mode():
            return engine.runner.paged.forward([BatchItem(ids, 0, seq.block_table)]).float().clone()
    finally:
        engine.blocks.free_sequence(seq)


def test_after_a_step_the_engine_decodes_with_the_new_weights_and_releases_its_kv(root, monkeypatch):
    cfg = load_config(TINY_DENSE, _overrides(root, "sync", steps=2, **{"optim.lr": 1e-2}))
    rollouts = EngineRollouts(cfg)
    trainer = Trainer(cfg, rollouts=rollouts)
    assert rollouts.model is trainer.model  # one process: the engine runs the policy's own parameters
    engines, awake_bytes = [], []  # every engine the rollout phases build, and its KV bytes at each phase's end
    build, sleep = LLMEngine.from_model, LLMEngine.sleep

    def traced(*args, **kwargs):
        engine = build(*args, **kwargs)
        engines.append(engine)
        return engine

    def traced_sleep(engine):
        awake_bytes.append(engine.kv.nbytes)
        sleep(engine)
    monkeypatch.setattr(LLMEngine, "from_model", traced)
    monkeypatch.setattr(LLMEngine, "sleep", traced_sleep)
    ids = trainer.data.train.next_batch().tokens[0, :20].tolist()
    with torch.no_grad():
        before = trainer.model(ModelInput(tokens=torch.tensor([ids]))).logits[0].float()
    trainer.train()
    # one engine for both phases, its KV cache allocated during each and released after it
    assert len(engines) == 1 and engines[0] is rollouts.kept
    assert len(awake_bytes) == 2 and awake_bytes[0] == awake_bytes[1] > 0
    assert rollouts.kept.sleeping and rollouts.kept.kv.nbytes == 0 and len(rollouts.kept.blocks.cache) == 0
    with torch.no_grad():
        after = trainer.model(ModelInput(tokens=torch.tensor([ids]))).logits[0].float()
    engine = rollouts.engine(1)
    got = _engine_logits(engine, ids)
    engine.close()
    assert float((after - before).abs().max()) > 1e-4  # the step moved the weights (10x the tolerance below)
    torch.testing.assert_close(got, after, rtol=1e-5, atol=1e-5)


def test_a_groups_completions_reuse_its_first_prefill_and_sample_what_all_at_once_samples(root):
    cfg = load_config(TINY_DENSE, _overrides(root, "staged"))
    rollouts = EngineRollouts(cfg)
    Trainer(cfg, rollouts=rollouts)
    prompts, G = [list(range(3, 23)), list(range(40, 61))], 4  # 20 and 21 tokens: one whole 16-token block each
    engine = rollouts.engine(len(prompts) * G)
    staged = [(list(o.token_ids), [lp.logprob for lp in o.logprobs])
              for o in _generate(engine, prompts, G, 6, 1.0, [7, 70])]
    assert engine.blocks.cache.hit_tokens == len(prompts) * (G - 1) * 16  # the group's others hit the first's block
    engine.close()
    engine = rollouts.engine(len(prompts) * G)  # the same requests added all at once
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=1.0, seed=s + j, logprobs=0))
           for p, s in zip(prompts, [7, 70]) for j in range(G)]
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.blocks.cache.hit_tokens == 0
    at_once = [(list(done[i].token_ids), [lp.logprob for lp in done[i].logprobs]) for i in ids]
    engine.close()
    assert [t for t, _ in staged] == [t for t, _ in at_once] and len({tuple(t) for t, _ in staged}) > 1
    for (_, mine), (_, want) in zip(staged, at_once):
        assert mine == pytest.approx(want, abs=1e-5)


def test_tessera_train_raises_the_toy_tasks_mean_reward_and_logs_the_grpo_metrics(root, capsys):
    """Completions that start with a digit score 1: ~8% of a random model's; 16 seeded steps of 8
    prompts x 8 completions lift the mean reward by more than 0.4."""
    run = root / "toy"
    args = _overrides(root, "toy", steps=16, **{"optim.lr": 1e-2, "train.global_batch_size": 8,
                                                 "train.micro_batch_size": 4, "train.grpo.group_size": 8})
    assert main(["train", TINY_DENSE, *set_args(args)]) == 0
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, 17))
    for r in records:
        assert all(isinstance(r[k], float) and math.isfinite(r[k]) for k in KEYS), r
        assert r["reward_failures"] == 0 and 1 <= r["response_length"] <= 4 and r["rollout_tokens_per_s"] > 0
        assert r["logprob_diff_max"] < 1e-4 and r["logprob_diff_mean"] < 1e-5  # fp32 engine and trainer
    first = sum(r["reward_mean"] for r in records[:3]) / 3
    last = sum(r["reward_mean"] for r in records[-3:]) / 3
    assert first < 0.3 and last > first + 0.4, [r["reward_mean"] for r in records]
    err = capsys.readouterr().err
    assert "objective: GRPO, 8 completions per prompt of up to 4 tokens at temperature 1 from the serving engine, " \
           "reward regex_format" in err
    assert "batch: 8 prompts x 8 completions x 48 tokens" in err


def test_a_reward_that_raises_or_returns_nan_scores_0_and_is_counted(root, tmp_path, monkeypatch):
    (tmp_path / "shaky_reward.py").write_text(
        "def reward(prompt, completion, answer, **fields):\n"
        "    if answer % 4 == 0:\n        raise ValueError('no')\n"
        "    return float('nan') if answer % 4 == 1 else 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(TINY_DENSE, _overrides(root, "shaky", steps=2, **{"train.grpo.reward": "shaky_reward:reward",
                                                                        "train.global_batch_size": 8}))
    trainer = Trainer(cfg, rollouts=EngineRollouts(cfg))
    trainer.train()
    records = _records(root / "shaky")
    for r in records:  # every batch holds all eight prompts: answers 0, 4 raise, 1, 5 give NaN, x 4 completions
        assert r["reward_failures"] == 16 and r["reward_mean"] == 0.5, r


def test_a_reward_module_that_does_not_exist_is_refused_in_one_line_before_start(root, capsys):
    args = _overrides(root, "missing", **{"train.grpo.reward": "no_such_module:score"})
    assert main(["train", TINY_DENSE, *set_args(args)]) == 2
    err = capsys.readouterr().err
    assert "train.grpo.reward='no_such_module:score' is invalid: no module named 'no_such_module'" in err
    assert not (root / "missing").exists()
    assert main(["train", TINY_DENSE, "--nproc", "2", *set_args(args)]) == 2  # the launcher refuses, no rank starts
    assert "no module named 'no_such_module'" in capsys.readouterr().err and not (root / "missing").exists()
    with pytest.raises(ConfigError, match=r"module 'json' has no function 'nothing'"):
        EngineRollouts(load_config(TINY_DENSE, _overrides(root, "r", **{"train.grpo.reward": "json:nothing"})))


def test_a_prompt_longer_than_the_context_is_refused_naming_its_line(root, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 60}) + "\n")
    cfg = load_config(TINY_DENSE, _overrides(root, "long", **{"data.datasets": f"[{{path: {path}}}]"}))
    with pytest.raises(DataError, match=r"long.jsonl:2: the prompt is \d+ tokens, longer than the 45 the "
                                        r"context leaves \(49 tokens"):
        Trainer(cfg, rollouts=FixedRollouts(4))


@pytest.mark.parametrize("extra,message", [
    ({"train.grpo.group_size": 1}, r"train.grpo.group_size=1 is invalid: >= 2 \(a group of one completion has no "
                                   r"advantage"),
    ({"train.grpo.reward": "not a name"}, r"train.grpo.reward='not a name' is invalid: one of exact_numeric, "
                                          r"regex_format, unit_tests or module:function"),
    ({"train.grpo.temperature": 0}, r"train.grpo.temperature=0.0 is invalid: a finite number > 0"),
    ({"train.grpo.max_new_tokens": 49}, r"train.grpo.max_new_tokens=49 is invalid: in \[1, train.seq_len=48\]"),
    ({"train.grpo.loss_averaging": "batch"}, r"train.grpo.loss_averaging='batch' is invalid: one of token, sequence"),
    ({"data.kind": "preference"}, r"data.kind='preference' is invalid: pretrain, sft or vision_sft with "
                                  r"train.objective=grpo"),
    ({"train.objective": "lm"}, r"data.kind='prompts' is invalid: pretrain, sft or vision_sft with train.objective=lm"),
    ({"parallel.cp": 2}, r"parallel.cp=2 is invalid: 1 with train.objective=grpo \(GRPO runs in one process and "
                         r"under dp_replicate / dp_shard / tp only\)"),
    ({"train.dtype": "fp16"}, r"train.dtype='fp16' is invalid: fp32 or bf16 with train.objective=grpo"),
    ({"train.eval_interval": 5}, r"train.eval_interval=5 is invalid: 0 with train.objective=grpo"),
])
def test_what_grpo_does_not_take_is_refused_by_name(root, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_DENSE, _overrides(root, "r", **extra))


def test_the_config_chooses_the_grpo_mode_and_a_trainer_without_rollouts_is_told_how(root):
    cfg = load_config(TINY_DENSE, _overrides(root, "no-rollouts"))
    assert training_mode(cfg).name == "grpo" and cfg.train.grpo.group_size == 4
    with pytest.raises(ConfigError, match=r"train.objective=grpo needs the serving engine's rollouts: .* pass "
                                          r"Trainer\(cfg, rollouts=tessera.eval.rollouts.EngineRollouts\(cfg\)\)"):
        Trainer(cfg)


def _grpo_on_ranks(overrides: list[str], config: str = TINY_DENSE) -> dict:
    """Runs on every rank (and in one process): train; the records, the whole weights and, after the
    last step, the largest difference between the engine's logits and the policy's."""
    cfg = load_config(config, overrides)
    rollouts = EngineRollouts(cfg)
    trainer = Trainer(cfg, rollouts=rollouts)
    sampled, sample = [], rollouts.rollouts  # the prompts this rank's engine samples (counted)

    def counted(prompts, *args):
        sampled.extend(prompts)
        return sample(prompts, *args)
    rollouts.rollouts = counted
    result = trainer.train()
    ids = trainer.data.train.next_batch().tokens[0, :20].tolist()
    with torch.no_grad():
        want = trainer.model(ModelInput(tokens=torch.tensor([ids]))).logits[0].float()
    want = want.full_tensor() if isinstance(want, DTensor) else want  # tp: sharded on the vocabulary
    rollouts.sync()  # what each rollout phase starts with (a collective under dp_shard)
    if rollouts.spans_tp:  # tp: one engine over the group's shards, the policy's or gathered (rank 0 reads it)
        from tests.train.test_grpo_tp_shared import on_group
        got = on_group(rollouts, 1, lambda engine: _engine_logits(engine, ids))
    else:
        engine = rollouts.engine(1)
        got = _engine_logits(engine, ids)
        engine.close()
    return {"records": result.records, "weights": whole_parameters(trainer.parts),
            "engine_diff": float((got - want).abs().max()) if got is not None else None,
            "shared": rollouts.model is trainer.model, "spans_tp": rollouts.spans_tp, "sampled": len(sampled),
            "engine_numel": sum(p.numel() for p in rollouts.model.parameters())}


GRPO_LAYOUTS = [  # (ranks, layout, whether one engine spans the tp group: its shards the policy's, or gathered)
    pytest.param(2, {"parallel.dp_shard": 2}, False, id="fsdp2"),
    pytest.param(2, {"parallel.tp": 2, "parallel.dp_shard": 1}, True, id="tp2"),
    pytest.param(2, {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}, True, id="tp2-sp"),
    pytest.param(4, {"parallel.tp": 2, "parallel.dp_shard": 2}, True, id="tp2-fsdp2", marks=pytest.mark.slow),
]


LAYOUT_RUN = {"optim.lr": 1e-2, "optim.eps": 1e-3, "train.micro_batch_size": 1}


@pytest.fixture(scope="module")
def one_process(root) -> dict:
    """The one-process run every layout must equal."""
    return _grpo_on_ranks(_overrides(root, "one", steps=3, **LAYOUT_RUN))


MOE_RUN = {**LAYOUT_RUN, "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.ffn_dim": 64}


@pytest.fixture(scope="module")
def one_process_moe(root) -> dict:
    """The one-process MoE run its layouts must equal."""
    return _grpo_on_ranks(_overrides(root, "one-moe", steps=3, **MOE_RUN), TINY_MOE)


@pytest.mark.dist
@pytest.mark.parametrize("world,layout,aliased", GRPO_LAYOUTS)
def test_under_dp_shard_and_tp_the_engine_reads_the_policys_weights_and_the_ranks_train_the_one_process_policy(
        root, one_process, world, layout, aliased):
    run = "-".join(f"{k.split('.')[-1]}{v}" for k, v in layout.items())
    got = run_ranks(_grpo_on_ranks, world, _overrides(root, run, steps=3, **{**LAYOUT_RUN, **layout}), timeout=HANG_S)
    _assert_one_process_run(one_process, got, world, layout, aliased)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world,layout", [
    pytest.param(2, {"parallel.tp": 2, "parallel.dp_shard": 1}, id="tp2"),
    pytest.param(4, {"parallel.tp": 2, "parallel.dp_shard": 2}, id="tp2-fsdp2")])
def test_an_moe_policy_under_tp_and_dp_shard_samples_from_tp_shards_and_trains_the_one_process_policy(
        root, one_process_moe, world, layout):
    run = "moe-" + "-".join(f"{k.split('.')[-1]}{v}" for k, v in layout.items())
    overrides = _overrides(root, run, steps=3, **{**MOE_RUN, **layout})
    got = run_ranks(_grpo_on_ranks, world, overrides, TINY_MOE, timeout=HANG_S)
    _assert_one_process_run(one_process_moe, got, world, layout, True)


def _assert_one_process_run(ref: dict, got: list[dict], world: int, layout: dict, aliased: bool) -> None:
    """The ranks' run (`_grpo_on_ranks`) sampled as `aliased` says and trained `ref`'s policy."""
    assert ref["shared"] and not got[0]["shared"]  # shards: no whole model shared with the engine
    # tp: one engine over the tp group's shards, the policy's own (tests/train/test_grpo_tp_shared.py) or, with
    # dp_shard, gathered over dp_shard into this rank's tp shard; dp_shard alone: a whole copy
    assert all(rank["spans_tp"] == aliased for rank in got)
    assert all((rank["engine_numel"] < ref["engine_numel"]) == aliased for rank in got)  # a tp shard, not whole
    # the 12 prompts of the run: each dp rank samples its rows; tp peers every tp-th of them, or, when one
    # engine spans them, each is handed all of its rows (rank 0 drives the engine for them all)
    tp = 2 if "parallel.tp" in layout else 1
    share = 12 * tp // world if aliased else 12 // world
    assert ref["sampled"] == 12 and all(rank["sampled"] == share for rank in got)
    for rank in got:
        assert rank["engine_diff"] is None or rank["engine_diff"] < 1e-5, rank["engine_diff"]
        for name, value in ref["weights"].items():
            torch.testing.assert_close(rank["weights"][name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert got[0]["engine_diff"] is not None  # rank 0 reads the engine in every layout
    assert ref["engine_diff"] < 1e-5 and sum(r["grad_norm"] > 0 for r in ref["records"]) >= 2  # the policy moved
    for mine, want in zip(got[0]["records"], ref["records"], strict=True):  # the same completions and rewards
        for key in ("reward_mean", "reward_std", "response_length", "loss"):
            assert mine[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (mine["step"], key)


def _train_records(overrides: list[str], resume: bool = False) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = load_config(TINY_DENSE, overrides)
    trainer = Trainer(cfg, resume=resume, rollouts=EngineRollouts(cfg))
    result = trainer.train()
    return result.records, {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def test_a_stopped_and_resumed_run_samples_and_trains_as_the_straight_one(root):
    extra = {"optim.lr": 1e-2, "optim.total_steps": 4, "checkpoint.interval": 2}
    straight, want = _train_records(_overrides(root, "straight", steps=4, **extra))
    _train_records(_overrides(root, "split", steps=2, **extra))
    resumed, got = _train_records(_overrides(root, "split", steps=4, **extra), resume=True)
    assert [r["step"] for r in resumed] == [3, 4]
    for mine, theirs in zip(resumed, straight[2:], strict=True):  # the same completions, rewards and update
        for key in ("reward_mean", "reward_std", "response_length", "loss", "grad_norm"):
            assert mine[key] == theirs[key], (mine["step"], key)
    for name, value in want.items():
        assert torch.equal(got[name], value), name

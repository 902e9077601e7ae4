"""The DPO step (tessera/train/modes/dpo.py) against TRL's DPOTrainer as the oracle: on the same
batch of pairs, with the same policy and reference weights, Tessera's loss, rewards, log-probabilities
and the policy's gradient equal what TRL's `compute_loss` computes with a transformers model (fp32,
1e-5), for the sigmoid and IPO losses; and each answer's log-probability equals the one computed by
hand from transformers' logits. The batch spans two micro-batches, so the accumulation is checked too."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tessera.checkpoint.hf.names import hf_names
from tessera.config.schema import load_config
from tessera.models.model_input import ModelInput
from tessera.train.objectives.loss import IGNORE_INDEX, masked_targets
from tessera.train.objectives.preference_loss import answer_logps
from tessera.train.trainer import Trainer
from tests.infer.tiny_models import write_model

RECORDS = [
    {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "It is 6, I believe."},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}], "rejected": [{"role": "assistant", "content": "Rome"}]},
    {"prompt": "Name a colour", "chosen": "Blue, like the sky.", "rejected": "Seven"},
    {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again?"}],
     "chosen": "sure, hello again", "rejected": "no"},
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny LLaMA directory (the reference: the run's initial weights) and, in memory, the policy:
    the same model moved off it, as a policy is after some steps."""
    root = tmp_path_factory.mktemp("dpo_trl")
    reference = write_model(root / "hf", seed=3)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(11)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root, reference, policy


def _tessera(root: Path, loss: str, beta: float, run: str) -> Trainer:
    return Trainer(load_config(None, [
        f"run_dir={root / run}", "train.device=cpu", f"train.init_from={root / 'hf'}",
        f"data.tokenizer={root / 'hf'}", "data.kind=preference", "train.objective=dpo",
        f"data.datasets=[{{path: {root / 'prefs.jsonl'}}}]", "train.seq_len=96", "train.micro_batch_size=2",
        "train.global_batch_size=4", f"train.dpo.loss={loss}", f"train.dpo.beta={beta}", "log.tensorboard=false",
        "log.progress_bar=false"]))


def _trl(root: Path, policy, reference, loss: str, beta: float):
    import transformers as tf
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=str(root / f"trl-{loss}"), beta=beta, loss_type=[loss], report_to=[], use_cpu=True,
                     per_device_train_batch_size=4, bf16=False, fp16=False)
    unused = Dataset.from_list([RECORDS[1]])  # the trainer wants one; the batch is given to compute_loss
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=unused,
                         processing_class=tf.AutoTokenizer.from_pretrained(root / "hf"))
    trainer.model.train()
    return trainer


def _trl_inputs(tokens: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Tessera batch of pairs [B, 2, S + 1] as TRL's collator lays one out: the B chosen sequences,
    then the B rejected ones, `completion_mask` on the answers (the padding is after every real token,
    so a full attention mask leaves the answers' logits as they are under the causal mask)."""
    ids = torch.cat([tokens[:, 0], tokens[:, 1]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "completion_mask": torch.cat([mask[:, 0], mask[:, 1]]).long()}


@pytest.mark.parametrize("loss,beta", [("sigmoid", 0.1), ("ipo", 0.5)])
def test_loss_rewards_and_gradients_equal_trls_dpo_trainer(models, loss, beta):
    root, reference, policy = models
    trainer = _tessera(root, loss, beta, f"run-{loss}")
    batch = trainer.data.train.next_batch()
    assert batch.tokens.shape == (4, 2, 97)
    names = hf_names(trainer.cfg.model)
    theirs = dict(policy.named_parameters())
    with torch.no_grad():  # Tessera's policy takes the moved weights; its reference stays the directory's
        for name, p in trainer.model.named_parameters():
            p.copy_(theirs[names[name][0]])
    result = trainer.engine.forward_backward(batch)

    policy = copy.deepcopy(policy)
    trl = _trl(root, policy, reference, loss, beta)
    want = trl.compute_loss(trl.model, _trl_inputs(batch.tokens, batch.loss_mask))
    want.backward()
    metrics = {k: v[-1] for k, v in trl._metrics["train"].items()}

    assert result.loss == pytest.approx(want.item(), rel=1e-5)
    assert result.loss > 1e-3 and abs(metrics["rewards/margins"]) > 1e-3  # the policy is off the reference
    # A reward is beta x (the policy's sum of log-probabilities - the reference's): fp32 sums of ~50 terms taken in
    # another order than TRL's, each within ~1e-6 of its size, so the reward's difference scales with the sums'
    # size, not the reward's (rewards/rejected -0.0685 from sums of ~ -40 to -55 moved 1.1e-6 on an AVX-512 CPU).
    reward_abs = beta * 1e-6 * 2 * max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    for ours, key in [("rewards/chosen", "rewards/chosen"), ("rewards/rejected", "rewards/rejected"),
                      ("rewards/margin", "rewards/margins"), ("rewards/accuracy", "rewards/accuracies"),
                      ("logps/chosen", "logps/chosen"), ("logps/rejected", "logps/rejected")]:
        bound = max(1e-6, reward_abs) if ours.startswith("rewards/") else 1e-6
        assert result.scalars[ours] == pytest.approx(metrics[key], rel=1e-5, abs=bound), ours
    grads = dict(policy.named_parameters())
    for name, p in trainer.model.named_parameters():  # within 1e-5 of each element or of the tensor's largest
        want = grads[names[name][0]].grad
        assert float(want.abs().max()) > 0, name
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_answer_log_probabilities_equal_transformers_by_hand(models):
    root, reference, _ = models
    trainer = _tessera(root, "sigmoid", 0.1, "run-logps")
    batch = trainer.data.train.next_batch()
    seqs, mask = batch.tokens.flatten(0, 1), batch.loss_mask.flatten(0, 1)
    targets = masked_targets(seqs[:, 1:], mask[:, 1:])
    with torch.no_grad():
        ours, counts = answer_logps(trainer.model(ModelInput(tokens=seqs[:, :-1])).logits, targets)
        logits = reference(input_ids=seqs[:, :-1]).logits.float()
    for row in range(seqs.shape[0]):
        scored = (targets[row] != IGNORE_INDEX).nonzero().flatten()
        assert len(scored) == int(counts[row]) > 0
        by_hand = sum(float(torch.log_softmax(logits[row, t], -1)[targets[row, t]]) for t in scored)
        assert float(ours[row]) == pytest.approx(by_hand, rel=1e-5), row

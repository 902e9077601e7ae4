"""`tessera eval MODEL --tasks loss`: the held-out loss equals the validation loss the trainer logged
for the same checkpoint; a checkpoint, its HuggingFace export and a copy converted to another
parallel layout give the same loss on the same data (the README's conversion check), which is
also transformers' own loss of the export; under --nproc the layout-converted copy is evaluated
on its layout."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.cli import main
from tests.train.runs import TINY_DENSE, set_args, shrink

GEOMETRY = ["--set", "train.seq_len=32", "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=2",
            "--set", "train.device=cpu"]


@pytest.fixture(scope="module")
def trained_run(small_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "tiny"
    overrides = shrink(small_dataset, run, 4, **{"train.eval_interval": 4, "train.eval_steps": 3,
                                                "data.valid_fraction": 0.1})
    assert main(["train", TINY_DENSE, *set_args(overrides)]) == 0
    return run


def _loss(tmp_path, *argv: str) -> dict:
    out = tmp_path / f"loss-{len(list(tmp_path.glob('loss-*')))}.json"
    assert main(["eval", *argv, "--tasks", "loss", "--output", str(out)]) == 0
    return json.loads(out.read_text())["results"]["loss"]


def test_loss_of_a_run_equals_the_validation_loss_its_trainer_logged(trained_run, tmp_path):
    logged = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    result = _loss(tmp_path, str(trained_run))
    assert result["loss"] == val_loss  # the trainer's own evaluation: bit for bit
    assert result["perplexity"] == pytest.approx(torch.exp(torch.tensor(val_loss, dtype=torch.float64)).item())
    assert result["tokens"] == 3 * 4 * 32  # train.eval_steps global batches of 4 samples of 32 targets
    assert _loss(tmp_path, str(trained_run), "--limit", "1")["tokens"] == 4 * 32


def test_checkpoint_hf_export_and_layout_copy_agree(trained_run, small_dataset, tmp_path, capsys):
    """The README's conversion check, its commands as written (only the device pinned, as every CPU
    test does): with --data the three get the same batch geometry whatever their origin, though the
    run was trained at another."""
    hf, copy = tmp_path / "hf", tmp_path / "tp2-fsdp2"
    assert main(["convert", str(trained_run), str(hf)]) == 0
    assert main(["convert", str(hf), str(copy), "--set", "parallel.tp=2", "--set", "parallel.dp_shard=2"]) == 0
    data = ["--data", small_dataset, "--limit", "1", "--set", "train.device=cpu"]
    checkpoint = _loss(tmp_path, str(trained_run), *data)
    exported = _loss(tmp_path, str(hf), *data)
    converted = _loss(tmp_path, str(copy), *data)
    # one global batch of 16 samples of 64 targets (the model's context, under the default 256),
    # not the run's 4 samples of 32
    assert checkpoint == exported == converted and checkpoint["tokens"] == 16 * 64

    # transformers' own loss of the export over the same samples (the first 16 of 64 + 1 tokens)
    from transformers import AutoModelForCausalLM

    from tessera.data.sampling import PackedDataset

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    samples = PackedDataset(small_dataset, 64, split="train")
    tokens = torch.stack([torch.as_tensor(samples[i].tokens) for i in range(16)])
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    reference = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert checkpoint["loss"] == pytest.approx(reference, rel=1e-5)
    assert "loss" in capsys.readouterr().out


def test_a_hf_directory_without_data_and_a_run_without_validation_are_refused(trained_run, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["convert", str(trained_run), str(hf)]) == 0
    assert main(["eval", str(hf), "--tasks", "loss"]) == 2
    assert "pass --data" in capsys.readouterr().err
    assert main(["eval", str(trained_run), "--tasks", "loss", "--set", "data.valid_fraction=0"]) == 2
    assert "no validation split" in capsys.readouterr().err
    assert main(["eval", str(trained_run), "--tasks", "loss", "--data", str(tmp_path / "nothing")]) == 1
    assert "neither a dataset" in capsys.readouterr().err
    assert main(["eval", str(trained_run), "--tasks", "loss,loss"]) == 2
    assert main(["eval", str(trained_run), "--tasks", "loss,tiny_mc", "--nproc", "2"]) == 2
    assert "--nproc evaluates the loss task only" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.dist
def test_nproc_evaluates_the_layout_copy_on_its_layout(trained_run, small_dataset, tmp_path):
    hf, tp2 = tmp_path / "hf", tmp_path / "tp2"
    assert main(["convert", str(trained_run), str(hf)]) == 0
    assert main(["convert", str(hf), str(tp2), "--set", "parallel.tp=2", "--set", "parallel.dp_shard=1"]) == 0
    data = ["--data", small_dataset, "--limit", "2", *GEOMETRY]
    one_process = _loss(tmp_path, str(tp2), *data)
    two_ranks = _loss(tmp_path, str(tp2), *data, "--nproc", "2")
    assert two_ranks["tokens"] == one_process["tokens"]
    assert two_ranks["loss"] == pytest.approx(one_process["loss"], rel=1e-5)

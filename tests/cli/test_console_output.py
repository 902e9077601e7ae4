"""What `tessera train` and `tessera generate` tell the user: a start-up summary, the validation
loss at each evaluation, a warning when the schedule ends before the run, the commands that use
the final checkpoint; sampling with a fresh seed unless `--seed` asks for a repeatable one."""

from __future__ import annotations

import re

from tessera.cli import main
from tessera.config.schema import load_config
from tessera.models.counting import count_params
from tessera.train.run.console import schedule_warning, startup_summary
from tests.train.runs import TINY_MOE, moe_shrink, set_args


def test_schedule_warning_only_when_steps_outrun_total_steps(tmp_path):
    fixed = load_config(TINY_MOE, [f"run_dir={tmp_path}", "train.steps=400", "optim.total_steps=200"])
    assert "train.steps=400 is beyond optim.total_steps=200: steps 201..400" in schedule_warning(fixed)
    assert schedule_warning(load_config(TINY_MOE, [f"run_dir={tmp_path}", "train.steps=400"])) is None
    # The bundled config lets the schedule follow train.steps, as the README's --set train.steps=400 expects.
    assert load_config(TINY_MOE, []).optim.total_steps is None


def test_startup_summary_names_size_layout_data_and_places(tmp_path):
    cfg = load_config(TINY_MOE, [f"run_dir={tmp_path / 'run'}"])
    text = "\n".join(startup_summary(cfg, 1, "cpu", 2, 0))
    total, active = count_params(cfg.model), count_params(cfg.model, active=True)
    assert f"{total / 1e6:.1f}M parameters, {active / 1e6:.1f}M active per token" in text
    assert "layout: 1 process on cpu" in text and "bundled corpus" in text
    assert str(tmp_path / "run" / "metrics.jsonl") in text and str(tmp_path / "run" / "checkpoints") in text


def test_train_prints_summary_validation_loss_and_next_steps(small_dataset, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = moe_shrink(small_dataset, run, 2, **{"train.eval_interval": 1, "data.valid_fraction": 0.2})
    assert main(["train", TINY_MOE, *set_args(overrides)]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("model: mixtral, ") and "run directory: " + str(run) in err
    assert re.search(r"^step 1: validation loss \d+\.\d{4} \(perplexity", err, re.M)
    assert re.search(r"^step 2: validation loss \d+\.\d{4}", err, re.M)
    assert "warning: train.steps" not in err
    assert f"checkpoint: {run / 'checkpoints' / 'step_00000002'}" in out
    for command in (f"tessera train {run / 'config.yaml'} --resume", f"tessera generate {run} ",
                    f"tessera serve {run}", f"tessera convert {run} "):
        assert command in out, command

    sample = ["generate", str(run), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "1.0"]
    seeds, texts = [], []
    for _ in range(2):
        assert main(sample) == 0
        out, err = capsys.readouterr()
        seeds.append(int(re.search(r"^seed (\d+) \(pass --seed \1 to repeat", err, re.M).group(1)))
        texts.append(out)
    assert seeds[0] != seeds[1]  # a fresh seed each run (2**31 choices)
    assert main([*sample, "--seed", str(seeds[0])]) == 0
    out, err = capsys.readouterr()
    assert out == texts[0] and "seed" not in err

"""The training modes, by name: what the one training loop (trainer.py) trains, chosen by the config.

    "eagle"  train.eagle.target set: an EAGLE-3 draft head against a frozen target (train/modes/eagle.py)
    "dpo"    train.objective=dpo: the model on preference pairs against its frozen initial weights (train/modes/dpo.py)
    "lm"     otherwise: the `model` section's model on the data's next tokens (train/modes/lm.py), with its
             objective terms (MoE auxiliary losses, multi-token prediction, distillation)

`training_mode(cfg)` is the first entry whose `selects(cfg)` is true; "lm" selects every config, so
it comes last. A mode is a `TrainingMode` (train/modes/mode.py): `configure` gives the config the run
trains under, `build` the finished `ModeParts` the loop drives (a step engine, its parts and
optimizers, how a step is logged, the start-up and closing lines, the end-of-run hook).

Adding a mode (an objective such as preference or RL training, an adapter scheme such as LoRA):
1. One module under tessera/train/modes, e.g. `preference.py`, with
   - a step engine (the `StepEngine` protocol of step_engine.py) whose `forward_backward(batch)`
     accumulates the gradient of one global batch over this rank's rows and returns a `StepResult`
     (results.py): `loss` and `tokens` at least, its own figures in `scalars` (logged by name);
     `clip_grad_norm`, `update_expert_bias` and `evaluate` as the protocol says. Reuse the builder
     (tessera.train.builder: the model cut by the layout, frozen reference models) and the shared
     pieces of step_engine.py;
   - `build_<mode>_mode(ctx: ModeContext) -> ModeParts`: the engine, one optimizer per part, the
     parts' tensor shapes, a record function (metric_record.step_record, or the mode's own line),
     the start-up and closing lines, the end-of-run hook (`finish`: return None when there is
     nothing to write), `evaluates`, the progress bar's `label`;
   - when the run trains under another config than it was given, `configure`.
   The loop gives every mode the run lock, checkpoints and resuming of `engine.parts` with their
   optimizers, the schedule, clipping and the update, the stop signal, metrics.jsonl and the
   progress bar: the module writes none of them.
2. Its config section (tessera/config), with the refusals of what it does not support.
3. One line in `MODES` below, before "lm": `TrainingMode("<name>", <selects>, build_<mode>_mode)`.
4. Tests beside tests/train/test_eagle_train.py: a few steps lower the loss, two data-parallel
   ranks match one process, a stopped and resumed run continues as the straight one.
"""

from __future__ import annotations

from tessera.config.schema import RunConfig
from tessera.train.modes.dpo import build_dpo_mode
from tessera.train.modes.eagle import build_eagle_mode, configure_eagle
from tessera.train.modes.grpo import build_grpo_mode
from tessera.train.modes.lm import build_lm_mode
from tessera.train.modes.mode import TrainingMode


def _eagle(cfg: RunConfig) -> bool:
    return cfg.train.eagle.target is not None


def _dpo(cfg: RunConfig) -> bool:
    return cfg.train.objective == "dpo"


def _grpo(cfg: RunConfig) -> bool:
    return cfg.train.objective == "grpo"


def _always(cfg: RunConfig) -> bool:
    return True


MODES: tuple[TrainingMode, ...] = (
    TrainingMode("eagle", _eagle, build_eagle_mode, configure_eagle),
    TrainingMode("dpo", _dpo, build_dpo_mode),
    TrainingMode("grpo", _grpo, build_grpo_mode),
    TrainingMode("lm", _always, build_lm_mode),
)


def training_mode(cfg: RunConfig) -> TrainingMode:
    """The mode `cfg` trains: the first of `MODES` that selects it."""
    return next(mode for mode in MODES if mode.selects(cfg))

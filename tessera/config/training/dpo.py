"""`train.objective` and `train.dpo`: what a run's model is trained on, and Direct Preference
Optimization (the DPO mode of the training loop: tessera.train.modes.dpo).

    tessera train configs/tiny-dense.yaml --set train.objective=dpo --set data.kind=preference \
        --set 'data.datasets=[{path: prefs.jsonl}]' --set train.init_from=runs/tiny-dense-hf

`train.objective` is `lm` (the default: next-token prediction on the data, pretraining or SFT),
`grpo` (rewarded completions of prompts sampled by the serving engine: tessera.config.training.grpo, whose
runs these checks share) or `dpo` (Rafailov et al. 2023: the model learns to prefer each pair's
chosen answer over its rejected one, measured against a frozen reference model, the run's initial
weights). DPO reads `data.kind=preference` data, and that data kind trains only under `dpo`. The `model` section, the
layout, `optim`, the schedule and `checkpoint` apply as to any run; `train.global_batch_size` and
`train.micro_batch_size` count pairs. Data and tensor parallelism only (dp_replicate, dp_shard, the
distributed optimizer, tp with or without sp): pp, cp and ep are refused by name, and so are fp16,
distillation, an EAGLE target, multi-token prediction and a validation loss (there is no held-out
split of preference data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import require
from tessera.config.layout_rules import need_data_parallel_only
from tessera.config.training.grpo import PROMPTS_KIND, validate_grpo

OBJECTIVES = ("lm", "dpo", "grpo")
DPO_LOSSES = ("sigmoid", "ipo")
PREFERENCE_KIND = "preference"


@dataclass
class DPOConfig:
    """Direct Preference Optimization. For a pair with log-probabilities of its answers summed over
    the answer tokens, under the policy (pi) and the reference (ref),

        h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
        sigmoid: loss = -log sigmoid(beta h)                                  (Rafailov et al. 2023)
        ipo:     loss = (h' - 1 / (2 beta))^2, h' as h with each answer's      (Azar et al. 2023, as TRL
                 log-ratio divided by its number of answer tokens               computes it)

    averaged over the pairs of the global batch; each answer's reward is beta x its log-ratio."""

    beta: float = 0.1  # > 0: the strength of the pull towards the reference (IPO: its tau)
    loss: str = "sigmoid"  # one of DPO_LOSSES


def validate_objective(cfg: Any) -> None:
    """train.objective and train.dpo's values; the data, layouts and settings DPO and GRPO train under."""
    t, d = cfg.train, cfg.data
    require(t.objective in OBJECTIVES, "train.objective", t.objective,
            f"one of {', '.join(OBJECTIVES)} (lm: next-token prediction on the data; dpo: preference pairs; "
            "grpo: rewarded completions of prompts)")
    require(math.isfinite(t.dpo.beta) and t.dpo.beta > 0, "train.dpo.beta", t.dpo.beta, "a finite number > 0")
    require(t.dpo.loss in DPO_LOSSES, "train.dpo.loss", t.dpo.loss, f"one of {', '.join(DPO_LOSSES)}")
    for objective, kind, what in (("dpo", PREFERENCE_KIND, "preference pairs"), ("grpo", PROMPTS_KIND, "prompts")):
        if t.objective != objective:
            require(d.kind != kind, "data.kind", d.kind,
                    f"pretrain, sft or vision_sft with train.objective={t.objective} ({what} train under "
                    f"train.objective={objective})")
    if t.objective == "lm":
        return
    name = t.objective.upper()
    setting = f"train.objective={t.objective}"
    kind, records = ((PREFERENCE_KIND, "JSONL of prompt / chosen / rejected records") if t.objective == "dpo"
                     else (PROMPTS_KIND, "JSONL of prompt records"))
    require(d.kind == kind, "data.kind", d.kind, f"{kind} with {setting} ({records})")
    need_data_parallel_only(cfg.parallel, setting, name, tensor_parallel=True)
    require(t.dtype != "fp16", "train.dtype", t.dtype, f"fp32 or bf16 with {setting} ({name} trains without fp16 "
            "loss scaling)")
    require(t.distill.teacher is None, "train.distill.teacher", t.distill.teacher,
            f"null with {setting} (the reference model is the run's initial weights)")
    require(t.eagle.target is None, "train.eagle.target", t.eagle.target,
            f"null with {setting} (an EAGLE run trains a draft head on next tokens)")
    require(cfg.model.mtp_depth == 0, "model.mtp_depth", cfg.model.mtp_depth,
            f"0 with {setting} (the {name} objective has no multi-token-prediction term)")
    require(t.eval_interval == 0, "train.eval_interval", t.eval_interval,
            f"0 with {setting} ({kind} data has no validation split; the reward figures of metrics.jsonl "
            "measure the run)")
    if t.objective == "grpo":
        validate_grpo(cfg)

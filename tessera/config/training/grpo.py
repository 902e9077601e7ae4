"""`train.grpo`: Group Relative Policy Optimization (the GRPO mode of the training loop:
tessera.train.modes.grpo) on prompts (data.kind=prompts, tessera.data.prompts).

    tessera train configs/tiny-dense.yaml --set train.objective=grpo --set data.kind=prompts \
        --set 'data.datasets=[{path: prompts.jsonl}]' --set train.grpo.reward=exact_numeric

Each step the run's own serving engine (tessera.infer) samples `group_size` completions of up to
`max_new_tokens` tokens for each prompt of the global batch at `temperature`, with the policy's
current weights; `reward` scores each (a built-in verifier of tessera.eval.rewards, or a user's
`module:function` called as `reward(prompt, completion, **fields_of_the_record) -> float`); the
policy then takes `updates_per_rollout` steps on the clipped policy-gradient loss of the
group-normalised advantages (tessera.train.objectives.policy_gradient), with an optional k3 KL to
the run's initial weights (`kl_coef`), an entropy bonus and the truncated importance-sampling
correction of the engine's log-probabilities (`bitwise`: scored by the trainer's own forward, so
they equal its own exactly; `fp64_attention`: in fp32, both attend in float64, so the engine's agree with
the trainer's to ~1e-7). `train.global_batch_size` and `train.micro_batch_size` count prompts.
One process, data and tensor parallelism only (pp, cp, ep refused by name), not fp16, no distillation,
EAGLE target, multi-token prediction or validation loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessera.config.errors import require

PROMPTS_KIND = "prompts"
BUILTIN_REWARDS = ("exact_numeric", "regex_format", "unit_tests")
AVERAGING = ("token", "sequence")


@dataclass
class GRPOConfig:
    """GRPO's settings (module docstring; the loss: tessera.train.objectives.policy_gradient)."""

    group_size: int = 4  # >= 2: completions sampled per prompt, whose rewards are normalised together
    # a built-in verifier (BUILTIN_REWARDS: exact_numeric compares the last number of the completion with the
    # record's `answer`; regex_format matches `format_pattern` against the whole completion; unit_tests runs the
    # record's `test` against prompt + completion in the HumanEval sandbox) or `module:function`
    reward: str = "exact_numeric"
    format_pattern: str = r"\s*\S.*"  # regex_format: re.fullmatch of the whole completion text (DOTALL) scores 1
    max_new_tokens: int = 32  # >= 1: the longest completion; prompt + completion must fit train.seq_len + 1
    temperature: float = 1.0  # > 0: the sampling temperature (also the policy's, in the loss)
    kl_coef: float = 0.0  # >= 0: weight of the k3 KL to the initial weights (0: no reference model is built)
    entropy_coef: float = 0.0  # >= 0: weight of the entropy bonus
    clip_low: float = 0.2  # the ratio's clip range is [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    loss_averaging: str = "token"  # token: every completion token alike; sequence: every completion alike
    scale_rewards: bool = True  # advantages divided by the group's reward std (False: centred only)
    tis_cap: float | None = 2.0  # > 0: cap of the truncated importance weight engine -> trainer; None = off
    # >= 1: optimizer updates on each rollout (PPO epochs): the first at the sampling policy (ratio 1), the
    # others at the moved policy, whose ratio to the sampling policy the clip range bounds
    updates_per_rollout: int = 1
    # true: the log-probabilities of the sampled tokens that the importance weights and logprob_diff_* read are
    # scored by the trainer's own forward (its kernels, micro-batches and reduction order), not the paged
    # engine's, so they equal the trainer's exactly; the engine still samples the tokens
    bitwise: bool = False
    # true: the update runs each group in one row, its prompt once and each completion attending to it
    # (tessera.train.modes.grpo_packing); where the model or layout cannot, one row per completion, as false
    shared_prefix: bool = True
    # true: in an fp32 run the trainer and the engine take attention's products and sums in float64, each output
    # rounded back to fp32 (each then the fp32 value nearest the exact one, whatever order either sums in), so
    # their log-probabilities of the sampled tokens agree to ~1e-7; false: both attend in fp32 (cheaper
    # attention; ~3e-6 apart on SmolLM2-135M). Not with bitwise, whose log-probabilities are the trainer's own
    fp64_attention: bool = True


def wide_attention(cfg: Any) -> bool:
    """Whether the GRPO trainer and its engine attend in float64 (train.grpo.fp64_attention in an fp32 run,
    without bitwise)."""
    g = cfg.train.grpo
    return g.fp64_attention and cfg.train.dtype == "fp32" and not g.bitwise


def validate_grpo(cfg: Any) -> None:
    """train.grpo's values and what GRPO trains under (called for train.objective=grpo)."""
    g, t = cfg.train.grpo, cfg.train
    require(g.group_size >= 2, "train.grpo.group_size", g.group_size,
            ">= 2 (a group of one completion has no advantage: its reward is its group's mean)")
    require(g.reward in BUILTIN_REWARDS or _is_function_name(g.reward), "train.grpo.reward", g.reward,
            f"one of {', '.join(BUILTIN_REWARDS)} or module:function")
    require(1 <= g.max_new_tokens <= t.seq_len, "train.grpo.max_new_tokens", g.max_new_tokens,
            f"in [1, train.seq_len={t.seq_len}] (prompt + completion must fit the context)")
    require(math.isfinite(g.temperature) and g.temperature > 0, "train.grpo.temperature", g.temperature,
            "a finite number > 0 (GRPO learns from differences between sampled completions)")
    for key in ("kl_coef", "entropy_coef", "clip_low", "clip_high"):
        value = getattr(g, key)
        require(math.isfinite(value) and value >= 0, f"train.grpo.{key}", value, "a finite number >= 0")
    require(g.clip_low < 1, "train.grpo.clip_low", g.clip_low, "< 1 (the ratio's lower bound 1 - clip_low > 0)")
    require(g.loss_averaging in AVERAGING, "train.grpo.loss_averaging", g.loss_averaging,
            f"one of {', '.join(AVERAGING)}")
    require(g.updates_per_rollout >= 1, "train.grpo.updates_per_rollout", g.updates_per_rollout,
            ">= 1 (optimizer updates on each rollout)")
    require(g.tis_cap is None or (math.isfinite(g.tis_cap) and g.tis_cap > 0), "train.grpo.tis_cap", g.tis_cap,
            "null (off) or a finite number > 0")


def _is_function_name(text: str) -> bool:
    module, _, function = text.partition(":")
    return bool(module) and function.isidentifier() and all(p.isidentifier() for p in module.split("."))

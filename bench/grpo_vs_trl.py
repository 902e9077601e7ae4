"""GRPO on the CPU: Tessera (train.objective=grpo, rollouts by its own serving engine) vs TRL's
GRPOTrainer (rollouts by transformers' generate), same model, task, group size, steps and settings.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_vs_trl.py [--steps 10] [--rounds 2] [--rows-too]
        [--fp32-attention-too]
        [--out F]

The model is a random LLaMA (transformers) with the bundled tokenizer, written once to a temporary
HuggingFace directory that both start from. The task: examples/data/sums.jsonl's prompts, rendered
the way Tessera renders them (PLAIN_CHAT_TEMPLATE with the generation prompt; TRL gets that text as
its prompt), a reward of 1 for a completion that starts with a digit; `--prompts` prompts a step,
`--group` completions each, up to `--max-new-tokens` tokens at temperature 1, one update per rollout,
no KL, token-level averaging ("dapo" in TRL), AdamW at a constant `--lr`, no activation
recomputation (TRL's default `gradient_checkpointing=True` is turned off, as Tessera's run has
none). The two sides alternate `--rounds` times. Prints one JSON object: per side and round the
wall time of the training loop (construction excluded), its CPU time (the process's, all threads;
both sides run one thread), the completion tokens sampled, their rate, (prompt + completion) tokens
per second, completion tokens per CPU second (the figure a loaded machine moves least) and the mean
reward per step, the 1-minute load average after each run; and the ratios Tessera / TRL of the medians.
`--rows-too` also runs Tessera with one row per completion in its update (train.grpo.shared_prefix=false,
what the update ran before shared-prefix rows), as a third side of each round (`ratio_rows_*`).
`--fp32-attention-too` likewise runs Tessera attending in fp32 (train.grpo.fp64_attention=false; the
default attends in float64 in the trainer and the engine) (`ratio_fp32_*`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tessera.config.schema import load_config  # noqa: E402
from tessera.data import default_tokenizer  # noqa: E402
from tessera.data.chat_template import PLAIN_CHAT_TEMPLATE  # noqa: E402
from tessera.eval.rollouts import EngineRollouts  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

PROMPTS = ROOT / "examples" / "data" / "sums.jsonl"
DIGIT = re.compile(r"\d.*", re.DOTALL)


def write_model(directory: Path, seed: int) -> None:
    """A random LLaMA of 4 layers, dim 128, with the bundled tokenizer, as a HuggingFace directory."""
    import transformers as tf

    tokenizer = default_tokenizer()
    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=384,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, tie_word_embeddings=False,
                            eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.eos_id)
    tf.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save(directory)


def tessera_run(model: Path, run: Path, args, extra: tuple[str, ...] = ()) -> dict:
    cfg = load_config(None, [*extra,
        f"run_dir={run}", "train.device=cpu", f"train.init_from={model}", f"data.tokenizer={model}",
        "data.kind=prompts", "train.objective=grpo", f"data.datasets=[{{path: {PROMPTS}}}]",
        f"train.grpo.group_size={args.group}", f"train.grpo.max_new_tokens={args.max_new_tokens}",
        "train.grpo.reward=regex_format", r"train.grpo.format_pattern='\d.*'", "train.grpo.tis_cap=null",
        "train.seq_len=64", f"train.global_batch_size={args.prompts}", f"train.micro_batch_size={args.prompts}",
        f"train.steps={args.steps}", "train.eval_interval=0", "train.log_interval=1", f"optim.lr={args.lr}",
        f"optim.min_lr={args.lr}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.weight_decay=0",
        "train.grad_clip=1.0", "checkpoint.interval=0", "log.tensorboard=false", "log.progress_bar=false"])
    trainer = Trainer(cfg, rollouts=EngineRollouts(cfg))
    start, cpu = time.perf_counter(), time.process_time()
    result = trainer.train()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    records = result.records
    completion = sum(r["response_length"] * args.prompts * args.group for r in records)
    return {"wall_s": wall, "cpu_s": cpu, "completion_tokens": completion, "tokens": records[-1]["tokens_seen"],
            "reward_mean": [r["reward_mean"] for r in records]}


def _digit_reward(prompts, completions, **kwargs) -> list[float]:
    return [float(DIGIT.fullmatch(c) is not None) for c in completions]


def trl_run(model: Path, run: Path, args) -> dict:
    import transformers as tf
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tf.AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = tokenizer.eos_token
    ours = default_tokenizer()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    texts = [ours.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      chat_template=PLAIN_CHAT_TEMPLATE) for r in rows]
    config = GRPOConfig(output_dir=str(run), per_device_train_batch_size=args.prompts * args.group,
                        num_generations=args.group, max_completion_length=args.max_new_tokens, beta=0.0,
                        temperature=1.0, learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, max_grad_norm=1.0, max_steps=args.steps, use_cpu=True, report_to=[],
                        logging_steps=1, save_strategy="no", bf16=False, fp16=False, loss_type="dapo",
                        seed=args.seed, disable_tqdm=True, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=tf.AutoModelForCausalLM.from_pretrained(model), reward_funcs=[_digit_reward],
                          args=config, train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=tokenizer)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    logs = [h for h in trainer.state.log_history if "reward" in h]
    completion = sum(h["completions/mean_length"] * args.prompts * args.group for h in logs)
    prompt_tokens = sum(len(tokenizer(t)["input_ids"]) for t in texts) / len(texts) * args.prompts * args.group
    return {"wall_s": wall, "cpu_s": cpu, "completion_tokens": completion,
            "tokens": completion + prompt_tokens * len(logs), "reward_mean": [h["reward"] for h in logs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows-too", action="store_true",
                   help="also run Tessera with one row per completion in its update (train.grpo.shared_prefix=false)")
    p.add_argument("--fp32-attention-too", action="store_true",
                   help="also run Tessera attending in fp32 (train.grpo.fp64_attention=false)")
    p.add_argument("--out", help="also write the JSON object to this file (TRL logs to stdout as it trains)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {"machine": platform.platform(), "torch": torch.__version__, "args": vars(args), "tessera": [], "trl": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        write_model(model, args.seed)
        for r in range(args.rounds):
            sides = [("tessera", tessera_run), ("trl", trl_run)]
            if args.rows_too:
                sides.insert(1, ("tessera_rows", partial(tessera_run, extra=("train.grpo.shared_prefix=false",))))
            if args.fp32_attention_too:
                sides.insert(1, ("tessera_fp32", partial(tessera_run, extra=("train.grpo.fp64_attention=false",))))
            for side, run in sides:
                got = run(model, Path(tmp) / f"{side}-{r}", args)
                got["completion_tokens_per_s"] = got["completion_tokens"] / got["wall_s"]
                got["tokens_per_s"] = got["tokens"] / got["wall_s"]
                got["completion_tokens_per_cpu_s"] = got["completion_tokens"] / got["cpu_s"]
                out.setdefault(side, []).append(got)
                out.setdefault("load_average", []).append(os.getloadavg()[0])
    for key in ("completion_tokens_per_s", "tokens_per_s", "completion_tokens_per_cpu_s"):
        ours = statistics.median(g[key] for g in out["tessera"])
        theirs = statistics.median(g[key] for g in out["trl"])
        out[f"ratio_{key}"] = ours / theirs
        for flag, side in ((args.rows_too, "rows"), (args.fp32_attention_too, "fp32")):
            if flag:
                out[f"ratio_{side}_{key}"] = statistics.median(g[key] for g in out[f"tessera_{side}"]) / theirs
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

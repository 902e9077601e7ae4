"""`tessera eval MODEL --tasks T1,T2 [--data PATH] [--include-path DIR] [--limit N] [--output FILE]`:
evaluate a run, a checkpoint or a HuggingFace directory on held-out loss, HumanEval and
lm-evaluation-harness tasks (`tessera.eval`); a table on stdout, the JSON document in --output.

`--nproc N` evaluates the loss on N local ranks under the checkpoint's parallel layout (or the one
`--set parallel.*` gives); `--tensor-parallel-size N` serves the generation and lm-eval tasks over
N ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

from tessera.config.argument_types import int_in, positive_float, temperature
from tessera.config.errors import ConfigError
from tessera.config.flags import values_from_args
from tessera.config.limits import MAX_LOCAL_RANKS
from tessera.infer.config import EngineConfig

# the served model's, as `tessera serve` spells them (--merge-lora DIR: a PEFT adapter merged at load)
ENGINE_OPTIONS = ("tensor_parallel_size", "dtype", "kv_cache_gib", "merge_lora", "windowed_kv")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a run directory, a Tessera checkpoint, or a HuggingFace (or pre-quantized) "
                                 "model directory")
    p.add_argument("--tasks", required=True, metavar="T1,T2",
                   help="comma-separated: loss, humaneval, and lm-eval task names (theirs or --include-path's)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="loss: a dataset PREFIX (of PREFIX.bin/.idx) or text / JSONL files (None: the run's "
                        "validation split, the batches its trainer evaluates)")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="a directory of lm-eval task YAML files (local tasks; nothing is downloaded)")
    p.add_argument("--limit", type=int_in(1, 2**31 - 1), default=None, metavar="N",
                   help="per task: the first N lm-eval documents / HumanEval problems / loss global batches "
                        "(None: all; for a run's loss, train.eval_steps batches)")
    p.add_argument("--output", default=None, metavar="FILE", help="write the results as JSON here")
    p.add_argument("--num-fewshot", type=int_in(0, 1024), default=None, help="lm-eval few-shot examples "
                   "(None: each task's own)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="loss: override a field of the run configuration it evaluates with, e.g. "
                        "train.seq_len=128 or train.dtype=bf16 (repeatable)")
    p.add_argument("--nproc", type=int_in(1, MAX_LOCAL_RANKS), default=None, metavar="N",
                   help="loss only: evaluate on N local ranks under the checkpoint's parallel layout (or --set "
                        "parallel.*)")
    engine = p.add_argument_group("serving engine (lm-eval tasks, humaneval)")
    EngineConfig.add_arguments(engine, ENGINE_OPTIONS)
    code = p.add_argument_group("humaneval")
    code.add_argument("--samples", type=int_in(1, 1000), default=1,
                      help="completions per problem (1: greedy, pass@1; n: sampled, pass@k for k in 1, 10, 100 <= n)")
    code.add_argument("--temperature", type=temperature, default=0.8, help="sampling temperature when --samples > 1")
    code.add_argument("--max-new-tokens", type=int_in(1, 2**20), default=512, help="tokens per completion at most")
    code.add_argument("--humaneval-mode", choices=("raw", "chat"), default="raw",
                      help="raw: the model continues the bare prompt (base models); chat: the prompt goes through the "
                           "model's chat template with an instruction to complete the function, and the code block "
                           "of the answer is tested (instruct models: the instruct protocol of evalplus / bigcode)")
    code.add_argument("--timeout", type=positive_float(3600), default=10.0,
                      help="seconds of wall-clock (and CPU) time each program may run")
    code.add_argument("--workers", type=int_in(1, 256), default=max(1, min(8, os.cpu_count() or 1)),
                      help="programs run at once")
    code.add_argument("--allow-unsandboxed-code", action="store_true",
                      help="where user namespaces are unavailable, run generated code with resource limits only "
                           "(it can then read and write your files and reach the network); without it such a "
                           "machine refuses")


def _settings(args: argparse.Namespace):
    from tessera.eval.humaneval import HumanEvalConfig
    from tessera.eval.sandbox import SandboxLimits
    from tessera.eval.suite import EvalSettings

    engine = values_from_args(EngineConfig, args, ENGINE_OPTIONS)
    humaneval = HumanEvalConfig(num_samples=args.samples, temperature=args.temperature,
                                max_tokens=args.max_new_tokens, workers=args.workers,
                                mode=args.humaneval_mode)
    return EvalSettings(data=args.data, include_path=args.include_path, limit=args.limit,
                        num_fewshot=args.num_fewshot, overrides=list(args.overrides), engine=engine,
                        humaneval=humaneval, sandbox=SandboxLimits(timeout_s=args.timeout),
                        allow_unsandboxed=args.allow_unsandboxed_code)


def start_line(args: argparse.Namespace, tasks: list[str]) -> str:
    """The line said when the evaluation is still running after a moment: what runs, so that minutes of
    generation are not silent."""
    what = ", ".join(tasks)
    if "humaneval" in tasks:
        n = "164" if args.limit is None else f"up to {args.limit}"
        what += (f" (humaneval: {n} problems x {args.samples} sample(s), {args.humaneval_mode} mode, up to "
                 f"{args.max_new_tokens} tokens each, then each program in the sandbox)")
    return f"tessera eval: loading {args.model}, then {what}; this may take minutes"


def _launch_ranks(args: argparse.Namespace, tasks: list[str]) -> int:
    """`--nproc N`: this command once per rank, without --nproc; rank 0 reports."""
    from tessera.parallel.jobs.launch import launch_local, module_command

    if tasks != ["loss"]:
        raise ConfigError(f"--nproc evaluates the loss task only (got --tasks {args.tasks}); serve the other tasks "
                          "over several ranks with --tensor-parallel-size")
    argv = ["eval", args.model, "--tasks", args.tasks, *(a for o in args.overrides for a in ("--set", o))]
    for flag, value in (("--data", args.data), ("--limit", args.limit), ("--output", args.output)):
        if value is not None:
            argv += [flag, str(value)]
    return launch_local(args.nproc, module_command("tessera", argv))


def run(args: argparse.Namespace) -> int:
    from tessera.eval.suite import parse_tasks

    tasks = parse_tasks(args.tasks)
    if args.output is not None:
        from tessera.eval.report import check_output

        check_output(args.output)  # now, not after the whole evaluation
    if args.nproc is not None:
        return _launch_ranks(args, tasks)
    from tessera.parallel.jobs.launch import rank_env, shutdown_distributed

    settings = _settings(args)
    env = rank_env()
    settings.keep_layout = env.launched  # a rank: the layout of the checkpoint (or --set parallel.*)
    from tessera.cli.notice import notice_if_slow
    from tessera.eval.suite import evaluate

    try:
        with notice_if_slow(start_line(args, tasks) if env.rank == 0 else ""):
            report = evaluate(args.model, tasks, settings)
    finally:
        shutdown_distributed()
    if env.rank != 0:
        return 0
    print(report.table())
    if args.output is not None:
        from tessera.eval.report import write_output

        write_output(report, args.output)
        print(f"results written to {args.output}", file=sys.stderr)
    return 0

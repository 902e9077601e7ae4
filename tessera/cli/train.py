"""`tessera train CONFIG [--set key=value ...] [--resume] [--nproc N [--max-restarts K]] [--profile A:B]`:
train a model from a run configuration, in this process, on N local ranks (`--nproc`), or as one rank
torchrun started. A rank that its launcher (`--max-restarts`, or torchrun's) started again after a
failure resumes from the newest good checkpoint as `--resume` would. `--profile A:B` records steps A
to B on every rank into run_dir/profile (`tessera profile RUN_DIR` reads them)."""

from __future__ import annotations

import argparse
import sys

from tessera.config.argument_types import int_in
from tessera.config.limits import MAX_LOCAL_RANKS, MAX_RESTARTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run configuration (YAML), e.g. configs/tiny-dense.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=100 (repeatable; YAML values)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in run_dir (start fresh if none)")
    p.add_argument("--nproc", type=int_in(1, MAX_LOCAL_RANKS), default=None, metavar="N",
                   help="start N local ranks (gloo on CPU, NCCL on GPUs) laid out by the parallel section, "
                        "N=1 too (one rank in a process group); None: this one process, no process group (or "
                        "the ranks torchrun started); for several nodes use torchrun (examples/slurm.sbatch)")
    p.add_argument("--max-restarts", type=int_in(0, MAX_RESTARTS), default=0, metavar="K",
                   help="with --nproc: when a rank fails, start all ranks again from the newest good checkpoint, "
                        "up to K times (not after a failure that repeats at the same step); restarts and their "
                        "causes go to run_dir/events.jsonl")
    p.add_argument("--profile", default=None, metavar="A:B",
                   help="record steps A to B (e.g. 20:25) on every rank into run_dir/profile: each phase's wall "
                        "time (data, forward/backward per micro-batch, each collective by group, optimizer, "
                        "checkpoint); `tessera profile RUN_DIR` analyses them; None: no recording")
    p.add_argument("--profile-torch", action="store_true",
                   help="with --profile A:B: torch.profiler over the same steps too, each rank's operators as a "
                        "Chrome trace in run_dir/profile/torch_rank<R>.json (large: keep the window short)")


def _launch_ranks(args: argparse.Namespace, cfg) -> int:
    """`--nproc N`: check the layout against N ranks, then run this command once per rank (N = 1
    too: the rank runs in a process group of one, as under torchrun --nproc-per-node 1)."""
    from tessera.parallel.dims import ParallelDims
    from tessera.parallel.jobs.launch import launch_local, module_command
    from tessera.train.run.layout import check_batch_layout

    dims = ParallelDims.from_config(cfg.parallel, args.nproc)
    dims.validate(cfg.model, args.nproc, seq_len=cfg.train.seq_len, vpp=cfg.parallel.stages_per_rank)
    check_batch_layout(cfg, dims)  # once, here, rather than the same error from every rank
    argv = ["train", args.config, *(a for o in args.overrides for a in ("--set", o))]
    argv += ["--profile", args.profile] if args.profile is not None else []
    argv += ["--profile-torch"] if args.profile_torch else []
    return launch_local(args.nproc, module_command("tessera", argv + (["--resume"] if args.resume else [])),
                        max_restarts=args.max_restarts, run_dir=cfg.run_dir)


def _warn_if_it_will_not_fit(cfg, nproc: int | None) -> None:
    """The planner's memory estimate, before any rank allocates: one warning line when it will not fit."""
    import os

    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 speaks for all
        return
    budget, reserved = cfg.train.memory_budget_gib, 0.0
    if budget is None:
        reserved = 3 * 2**30  # CUDA context, allocator slack, NCCL buffers
        import torch

        if not torch.cuda.is_available() or cfg.train.device == "cpu":
            return
        budget = torch.cuda.get_device_properties(0).total_memory / 2**30
    from tessera.plan.fits import check_fits

    world = nproc or int(os.environ.get("WORLD_SIZE", "1"))
    t = cfg.train
    message = check_fits(cfg.model, cfg.parallel, t.seq_len, t.micro_batch_size, t.global_batch_size, world,
                         f"{budget}GiB", dtype=t.dtype, reserved_bytes=reserved)
    if message is not None:
        print(f"warning: {message}", file=sys.stderr)


def _task_evaluator(cfg):
    """What runs train.eval_tasks at each evaluation (tessera.eval), or None when there are none."""
    if not cfg.train.eval_tasks:
        return None
    from tessera.eval.training import TrainingTasks

    return TrainingTasks(cfg)


def _rollouts(cfg):
    """What samples a GRPO run's completions: the serving engine and the reward (tessera.eval.rollouts),
    made before the trainer so that a reward that cannot be loaded stops the run in one line; else None."""
    if cfg.train.objective != "grpo":
        return None
    from tessera.eval.rollouts import EngineRollouts

    return EngineRollouts(cfg)


def run(args: argparse.Namespace) -> int:
    from tessera.config.errors import ConfigError
    from tessera.config.schema import load_config

    if args.max_restarts and args.nproc is None:
        raise ConfigError(f"--max-restarts={args.max_restarts} is invalid without --nproc N: the launcher that "
                          "--nproc starts is what restarts ranks (use --nproc 1 for one rank; under torchrun, "
                          "its own --max-restarts)")
    if args.profile is not None:
        from tessera.train.run.profile_record import parse_window

        parse_window(args.profile)  # a bad window is refused before any rank starts
    if args.profile_torch and args.profile is None:
        raise ConfigError("--profile-torch is invalid without --profile A:B: it traces the steps --profile records")
    cfg = load_config(args.config, args.overrides)  # before importing torch: config errors come at once
    _warn_if_it_will_not_fit(cfg, args.nproc)
    if args.nproc is not None:  # ranks in a process group, even one; without --nproc this process trains
        if cfg.train.objective == "grpo":  # a reward that cannot be loaded stops the launcher, not each rank
            from tessera.eval.rewards import load_reward

            load_reward(cfg.train.grpo)
        return _launch_ranks(args, cfg)
    from tessera.parallel.jobs.progress import RankProgress

    progress = RankProgress.from_env()  # what the launcher of `--nproc` learns of this rank
    try:
        result, coordinator, closing = _train(args, cfg, progress)
    except Exception as e:
        error = _lost_peer(e) or e  # a peer that ended under a collective outside any phase: one line too
        if progress is not None:
            progress.failed(f"{type(error).__name__}: {error}")
        if error is not e:
            raise error from e
        raise
    return _summarize(cfg, result, coordinator, closing)


def _lost_peer(error: Exception):
    from tessera.parallel.jobs.collective_timeout import lost_peer
    from tessera.parallel.jobs.launch import rank_env

    env = rank_env()
    return lost_peer(error, env.rank, env.world_size)


def _train(args: argparse.Namespace, cfg, progress):
    """Build the trainer (resuming on `--resume` and in a restarted rank), say what it trains (its
    mode's start-up lines: tessera.train.modes.registry), train; the result, whether this rank is rank 0, and
    what the mode says at the end."""
    from tessera.parallel.jobs.launch import restart_count, shutdown_distributed
    from tessera.train.trainer import Trainer

    restart = restart_count()
    try:
        from tessera.train.run.profile_record import parse_window

        window = parse_window(args.profile) if args.profile is not None else None
        trainer = Trainer(cfg, resume=args.resume or restart > 0, progress=progress,
                          task_evaluator=_task_evaluator(cfg), rollouts=_rollouts(cfg), profile=window,
                          profile_torch=args.profile_torch, step_hooks=_thread_hooks(cfg))
        coordinator = trainer.layout.is_coordinator
        if coordinator:
            print("\n".join(trainer.startup_lines()), file=sys.stderr, flush=True)
        if trainer.resumed_from is not None and coordinator:
            again = f", restart {restart}" if restart else ""
            print(f"resuming from {trainer.resumed_from} (step {trainer.step}{again})", file=sys.stderr)
        elif restart and coordinator:
            print(f"restart {restart}: no checkpoint was written yet, starting from step 0", file=sys.stderr)
        if trainer.init_from is not None and coordinator:
            print(f"weights from {trainer.init_from} ({trainer.init_bytes_read / 2**20:.1f} MiB read by rank 0)",
                  file=sys.stderr)
        return trainer.train(), coordinator, trainer.closing_lines
    finally:
        shutdown_distributed()


def _thread_hooks(cfg) -> list:
    """On a CPU, the intra-op thread count kept to the cores other processes leave free (adaptive_threads.py)."""
    from tessera.cli.adaptive_threads import thread_hooks
    from tessera.config.devices import resolve_device

    return thread_hooks(cfg.train.adaptive_threads, resolve_device(cfg.train.device, key="train.device").split(":")[0])


def _summarize(cfg, result, coordinator: bool, closing) -> int:
    """Rank 0's last lines (what was trained, where it went, what to run next: the mode's); the exit
    status."""
    status = 128 + result.stopped_by_signal if result.stopped_by_signal is not None else 0
    if not coordinator:
        return status
    if result.last_step == result.start_step and result.stopped_by_signal is None:
        print(f"nothing to train: the run is at step {result.start_step} and train.steps={cfg.train.steps}")
        return 0
    out, err = closing(result)
    print("\n".join(out))
    if err:
        print("\n".join(err), file=sys.stderr)
    return status

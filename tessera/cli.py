"""The `tessera` command: parse arguments, then call one layer's public function.

    tessera train CONFIG [--set key=value ...] [--resume] [--nproc N]
    tessera preprocess INPUT ... --output PREFIX      (or --bundled: prepare the stdlib corpus)
    tessera generate CHECKPOINT --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]
    tessera convert SRC DST [--set parallel.K=V ...] (HuggingFace directory <-> Tessera checkpoint, tokenizer included;
                                                      --set: the checkpoint's chunks are that layout's shards)
    tessera plan CONFIG --gpus N [--search]          (memory, FLOPs, communication; layout search)
    tessera serve MODEL_DIR [--port P]               (OpenAI-compatible HTTP server)

Parsing imports no torch (`tessera --help` is instant): each command imports what it needs when it
runs. Every option's help shows its default.

A subcommand is a `Command(name, help, add_arguments, run)` in COMMANDS; adding one is a function
that declares its arguments, a function that runs it, and one line in the list. Bad input
(`TesseraError`) prints one line on stderr, no traceback: exit status 2 for configuration and layout errors,
1 for the others (a damaged or foreign checkpoint, a missing dataset).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tessera.config.argument_types import OneLineArgumentParser, int_in, seed, temperature, top_k, top_p
from tessera.config.errors import CheckpointError, ConfigError, ParallelError, TesseraError
from tessera.config.limits import MAX_LOCAL_RANKS, MAX_SEQ_LEN


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- train --------------------------------------------------------------------------------------

def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="run configuration (YAML), e.g. configs/tiny-dense.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=100 (repeatable; YAML values)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in run_dir (start fresh if none)")
    p.add_argument("--nproc", type=int_in(1, MAX_LOCAL_RANKS), default=None, metavar="N",
                   help="start N local ranks (gloo on CPU, NCCL on GPUs) laid out by the parallel section, "
                        "N=1 too (one rank in a process group); None: this one process, no process group (or "
                        "the ranks torchrun started); for several nodes use torchrun (examples/slurm.sbatch)")


def _launch_ranks(args: argparse.Namespace, cfg) -> int:
    """`--nproc N`: check the layout against N ranks, then run this command once per rank (N = 1
    too: the rank runs in a process group of one, as under torchrun --nproc-per-node 1)."""
    from tessera.parallel.dims import ParallelDims
    from tessera.parallel.launch import launch_local, module_command
    from tessera.train.run_layout import check_batch_layout

    dims = ParallelDims.from_config(cfg.parallel, args.nproc)
    dims.validate(cfg.model, args.nproc, seq_len=cfg.train.seq_len, vpp=cfg.parallel.vpp)
    check_batch_layout(cfg, dims)  # once, here, rather than the same error from every rank
    argv = ["train", args.config, *(a for o in args.overrides for a in ("--set", o))]
    return launch_local(args.nproc, module_command("tessera", argv + (["--resume"] if args.resume else [])))


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


def _train(args: argparse.Namespace) -> int:
    from tessera.config.schema import load_config

    cfg = load_config(args.config, args.overrides)  # before importing torch: config errors come at once
    _warn_if_it_will_not_fit(cfg, args.nproc)
    if args.nproc is not None:  # ranks in a process group, even one; without --nproc this process trains
        return _launch_ranks(args, cfg)
    from tessera.parallel.launch import shutdown_distributed
    from tessera.train import console
    from tessera.train.trainer import Trainer

    try:
        trainer = Trainer(cfg, resume=args.resume)
        coordinator = trainer.layout.is_coordinator
        if coordinator:
            warning = console.schedule_warning(cfg)
            lines = console.startup_summary(cfg, trainer.layout.world_size, str(trainer.device), trainer.accumulation,
                                            trainer.step, trainer.layout.backend)
            print("\n".join(lines + ([warning] if warning else [])), file=sys.stderr, flush=True)
        if trainer.resumed_from is not None and coordinator:
            print(f"resuming from {trainer.resumed_from} (step {trainer.step})", file=sys.stderr)
        if trainer.init_from is not None and coordinator:
            print(f"weights from {trainer.init_from} ({trainer.init_bytes_read / 2**20:.1f} MiB read by rank 0)",
                  file=sys.stderr)
        result = trainer.train()
    finally:
        shutdown_distributed()
    if not coordinator:
        return 128 + result.stopped_by_signal if result.stopped_by_signal is not None else 0
    if result.last_step == result.start_step and result.stopped_by_signal is None:
        print(f"nothing to train: the run is at step {result.start_step} and train.steps={cfg.train.steps}")
        return 0
    last = result.records[-1] if result.records else {}
    summary = f"trained steps {result.start_step + 1}..{result.last_step}"
    if "loss" in last:
        summary += f", last loss {last['loss']:.4f}"
    print(summary)
    print("\n".join(console.next_steps(cfg, result.checkpoint)))
    if result.stopped_by_signal is not None:
        print(f"stopped by {signal.Signals(result.stopped_by_signal).name}", file=sys.stderr)
        return 128 + result.stopped_by_signal
    return 0


# ---- preprocess ---------------------------------------------------------------------------------

def _preprocess_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", help=".txt / .jsonl files or directories of them")
    p.add_argument("--output", default=None, help="dataset prefix to write (PREFIX.bin and PREFIX.idx)")
    p.add_argument("--tokenizer", default=None, help="tokenizer file or directory (None: the bundled one)")
    p.add_argument("--jsonl-field", default="text", help="field of each JSONL record holding the text")
    p.add_argument("--text-mode", default="document", choices=["document", "line"],
                   help="a .txt file is one document, or each non-empty line is one")
    p.add_argument("--no-eos", action="store_true", help="do not end documents with the eos token")
    p.add_argument("--sft", action="store_true",
                   help="inputs are conversations (JSONL messages or prompt/response): also write the "
                        "answer-only loss mask PREFIX.mask (train with data.kind=sft)")
    p.add_argument("--bundled", action="store_true",
                   help="prepare the bundled stdlib corpus under --cache-dir instead (prints its prefix)")
    p.add_argument("--cache-dir", default=None,
                   help="with --bundled: where to prepare it (None: data.cache_dir's default)")


def _preprocess(args: argparse.Namespace) -> int:
    from tessera.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    if args.bundled:
        from tessera.data.corpus import prepare_corpus_dataset
        from tessera.train.data_source import default_cache_dir

        print(prepare_corpus_dataset(args.cache_dir or default_cache_dir(), tokenizer, show_progress=True))
        return 0
    if not args.inputs or not args.output:
        raise ConfigError("preprocess needs INPUT files and --output PREFIX (or --bundled)")
    if args.sft:
        from tessera.data.sft import preprocess_sft

        stats = preprocess_sft(args.inputs, args.output, tokenizer)
        print(f"wrote {args.output}.bin/.idx and {args.output}.mask.bin/.idx: {stats.documents} conversations, "
              f"{stats.tokens} tokens")
        return 0
    from tessera.data.preprocess import preprocess

    stats = preprocess(args.inputs, args.output, tokenizer, jsonl_field=args.jsonl_field,
                       text_mode=args.text_mode, append_eos=not args.no_eos)
    print(f"wrote {args.output}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens")
    return 0


# ---- generate -----------------------------------------------------------------------------------

def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint",
                   help="a run directory, a Tessera checkpoint, or a HuggingFace model directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int_in(0, MAX_SEQ_LEN), default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy; > 0 samples")
    p.add_argument("--top-k", type=top_k, default=None,
                   help="sample only among the k most likely tokens (None or 0: all)")
    p.add_argument("--top-p", type=top_p, default=None,
                   help="sample only within this probability mass, in (0, 1] (None: all)")
    p.add_argument("--seed", type=seed, default=None,
                   help="sampling seed, for repeatable samples (None: a fresh random seed, printed on stderr)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer file or directory (None: the run's data.tokenizer for a Tessera run, the "
                        "directory's own for a HuggingFace one)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole prefix every step instead of using the serving engine's KV cache "
                        "(slow: a check of the cached output)")


def _sampling_params(args: argparse.Namespace, max_tokens: int, stop_ids: list[int]):
    """The flags (already checked by their argparse types) as the engine's `SamplingParams`."""
    from tessera.infer.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_k=args.top_k or 0,
                          top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed or 0,
                          stop_token_ids=stop_ids)


def _generate(args: argparse.Namespace) -> int:
    """Load the model and its tokenizer, then continue the prompt on the serving engine (`LLM`)."""
    from tessera.checkpoint.loading import load_model, trained_tokenizer
    from tessera.data.tokenizer import load_tokenizer
    from tessera.infer.llm import LLM
    from tessera.infer.reference_generation import reference_generate

    source = args.tokenizer or trained_tokenizer(args.checkpoint)
    if source is None:
        raise CheckpointError(f"{args.checkpoint} has no tokenizer (tokenizer.json); pass --tokenizer, or "
                              "copy the model's tokenizer files into it")
    model = load_model(args.checkpoint).model
    tokenizer = load_tokenizer(source)
    if args.seed is None and args.temperature > 0:
        args.seed = random.SystemRandom().randrange(2**31)
        print(f"seed {args.seed} (pass --seed {args.seed} to repeat this sample)", file=sys.stderr)
    prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    if not prompt_ids:
        raise ConfigError("--prompt is empty after tokenization; give at least one character")
    room = model.cfg.max_seq_len - len(prompt_ids)
    if args.max_new_tokens == 0:
        print(args.prompt)
        return 0
    if room < 1:
        raise ConfigError(f"--prompt is {len(prompt_ids)} tokens; the model takes at most {model.cfg.max_seq_len} "
                          "positions, leaving none to generate: shorten the prompt")
    stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    params = _sampling_params(args, min(args.max_new_tokens, room), stop)
    if args.no_cache:
        new = reference_generate(model, prompt_ids, params, use_cache=False)
    else:  # one sequence: a KV cache just big enough for it, no batching or prefix reuse to set up
        llm = LLM(model, tokenizer=tokenizer, max_num_seqs=1, enable_prefix_caching=False,
                  max_model_len=len(prompt_ids) + params.max_tokens)
        new = llm.generate([prompt_ids], params)[0].token_ids
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    return 0


# ---- convert ------------------------------------------------------------------------------------

def _convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a HuggingFace model directory, or a Tessera run directory / checkpoint")
    p.add_argument("dst", help="the directory to write (the other format)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the written weights")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer written with the weights (Tessera -> HuggingFace) or recorded with them "
                        "(HuggingFace -> Tessera); None: the run's data.tokenizer, else the bundled one / the "
                        "HuggingFace directory's own")
    p.add_argument("--set", dest="layout", action="append", default=[], metavar="parallel.KEY=VALUE",
                   help="HuggingFace -> Tessera: write the checkpoint cut into the shards of this parallel layout, "
                        "e.g. --set parallel.tp=2 --set parallel.dp_shard=4 (repeatable; parallel.* keys only; "
                        "give dp_shard explicitly, unset counts as 1)")


def _convert(args: argparse.Namespace) -> int:
    from tessera.checkpoint.convert import convert

    kind, path = convert(args.src, args.dst, args.dtype, tokenizer=args.tokenizer, layout=args.layout)
    print(f"wrote {kind} directory {path}")
    return 0


def _serve_module():
    from tessera.infer import command

    return command


def _plan_module():
    from tessera.plan import command

    return command


COMMANDS: list[Command] = [
    Command("train", "train a model from a YAML run configuration", _train_arguments, _train),
    Command("preprocess", "tokenize text into an indexed dataset", _preprocess_arguments, _preprocess),
    Command("generate", "continue a prompt with a trained model", _generate_arguments, _generate),
    Command("convert", "convert between HuggingFace and Tessera checkpoints", _convert_arguments, _convert),
    Command("plan", "estimate memory, FLOPs, bubble and communication of a run; search layouts",
            lambda p: _plan_module().add_arguments(p), lambda a: _plan_module().run(a)),
    Command("serve", "serve a model over an OpenAI-compatible HTTP API",
            lambda p: _serve_module().add_arguments(p), lambda a: _serve_module().run(a)),
]


def build_parser(commands: list[Command] | None = None) -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="tessera",
                                     description="Train and serve dense and MoE language models.")
    parser.add_argument("--version", action="version", version=f"tessera {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in commands or COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tessera` and `python -m tessera`; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except (ConfigError, ParallelError) as e:  # bad input: the configuration or the layout
        print(f"tessera {args.command}: error: {_rank_prefix()}{_one_line(e)}", file=sys.stderr)
        return 2
    except TesseraError as e:
        print(f"tessera {args.command}: error: {_rank_prefix()}{_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tessera {args.command}: interrupted", file=sys.stderr)
        return 130


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tessera")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _rank_prefix() -> str:
    """'[rank R] ' in a process started as one rank of several (torchrun, --nproc), else ''."""
    import os

    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f"[rank {rank}] " if world.isdigit() and int(world) > 1 else ""  # several ranks print at once


if __name__ == "__main__":
    sys.exit(main())

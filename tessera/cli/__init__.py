"""The `tessera` command: parse arguments, then call one layer's public function.

    tessera train CONFIG [--set key=value ...] [--resume] [--nproc N]
    tessera preprocess INPUT ... --output PREFIX      (or --bundled: prepare the stdlib corpus)
    tessera generate CHECKPOINT --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]
    tessera convert SRC DST [--set parallel.K=V ...] (HuggingFace directory <-> Tessera checkpoint, tokenizer included;
                                                      --set: the checkpoint's chunks are that layout's shards;
                                                      MODEL.gguf -> HuggingFace directory)
    tessera plan CONFIG --gpus N [--search]          (memory, FLOPs, communication; layout search)
    tessera profile RUN_DIR [--html F] [--png F] [--json F]  (a `train --profile A:B` run's steps against the plan)
    tessera serve MODEL_DIR|MODEL.gguf [--port P]    (OpenAI-compatible HTTP server)
    tessera router --prefill URL --decode URL [--port P]  (prefill/decode disaggregation)
    tessera eval MODEL --tasks T1,T2 [--data PATH] [--include-path DIR] [--limit N] [--output FILE]
                                                     (held-out loss, HumanEval, lm-evaluation-harness tasks)
    tessera prune SRC DST [--target-params N] [--layers K --ffn-hidden-size F --num-heads H --num-kv-heads G
                          --experts E --hidden-size D] [--calibration DATA]
                                                     (HuggingFace in and out, ranked on calibration data)
    tessera quantize SRC DST --method gptq|smoothquant|fp8|rtn [--calibration DATA] [--bits B --group-size G
                             --actorder --alpha A]   (HuggingFace in, compressed-tensors HuggingFace out)

Parsing imports no torch (`tessera --help` is instant): each command imports what it needs when it
runs. Before it, the OpenMP threads are set to wait passively unless the user chose (`threads.py`).
Every option's help shows its default.

A subcommand is a module of this package with `add_arguments(parser)` and `run(args) -> int`, and a
`Command` line in COMMANDS. An error Tessera reports (`TesseraError`) prints one line on stderr, no
traceback, and sets the exit status by one rule for every subcommand (`exit_status.py`: 2 for bad
input, 1 for the rest).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from tessera.config.argument_types import OneLineArgumentParser
from tessera.config.errors import TesseraError


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str  # tessera.cli.<module>: its add_arguments(parser) and run(args); imported when needed

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self._module().add_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        return self._module().run(args)

    def _module(self):
        return importlib.import_module(f"tessera.cli.{self.module}")


COMMANDS: list[Command] = [
    Command("train", "train a model from a YAML run configuration", "train"),
    Command("preprocess", "tokenize text into an indexed dataset", "preprocess"),
    Command("generate", "continue a prompt with a trained model", "generate"),
    Command("convert", "convert between HuggingFace and Tessera checkpoints", "convert"),
    Command("plan", "estimate memory, FLOPs, bubble and communication of a run; search layouts", "plan"),
    Command("profile", "say what a profiled run's steps spent their time on, against the plan", "profile"),
    Command("serve", "serve a model over an OpenAI-compatible HTTP API", "serve"),
    Command("router", "prefill/decode disaggregation: route requests to a prefill and a decode `tessera serve`",
            "router"),
    Command("eval", "evaluate a model: held-out loss, HumanEval, lm-evaluation-harness tasks", "eval"),
    Command("prune", "prune a HuggingFace model's layers, FFN channels, heads, experts and hidden size to sizes or a "
                     "parameter target", "prune"),
    Command("quantize", "quantize a HuggingFace model once (gptq, smoothquant, fp8, rtn) into a compressed-tensors "
                        "directory", "quantize"),
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
    from tessera.cli.exit_status import report
    from tessera.cli.threads import apply_thread_defaults

    apply_thread_defaults()  # before any command imports torch (threads.py)
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except (TesseraError, KeyboardInterrupt) as e:
        return report(args.command, e)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tessera")
    except PackageNotFoundError:
        return "unknown (not installed)"

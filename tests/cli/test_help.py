"""`tessera --help` is quick and complete: building the parser imports no torch, and every option
of every subcommand says what it does and shows its default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from tessera.cli import COMMANDS, build_parser
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT

_PROBE = """
import sys
from tessera.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers", "tokenizers"))
print("HEAVY", heavy)
"""


@pytest.mark.parametrize("argv", [["--help"], *([c.name, "--help"] for c in COMMANDS)], ids=lambda a: " ".join(a))
def test_help_imports_no_torch(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=HANG_S)
    assert "usage: tessera" in run.stdout, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "HEAVY []"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", [c.name for c in COMMANDS])
def test_every_option_has_help_and_shows_its_default(name):
    parser = _subparsers()[name]
    assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"tessera {name} {action.dest}: no help"
        if action.option_strings:
            shown = argparse.ArgumentDefaultsHelpFormatter("tessera")._get_help_string(action)
            assert "%(default)" in shown, f"tessera {name} {action.option_strings[0]}: default not shown"


def test_serve_defaults_to_the_gpu_when_there_is_one():
    args = _subparsers()["serve"].parse_args(["some/model"])
    assert args.device == "auto"
    import torch

    from tessera.config.devices import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"

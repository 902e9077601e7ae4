"""Checkpoints for the untrusted-file tests: a small real one, and ways to tamper with it as an
attacker who controls every file would (the checksums in meta.json rewritten to match)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.checksums import file_digest
from tessera.checkpoint.dcp.model import save_model_checkpoint
from tessera.config import get_preset
from tessera.models import Transformer


class RunsShellCommand:
    """Pickles as a call of os.system: unpickling it with `pickle.load` runs `command`."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def small_checkpoint(root: Path) -> Path:
    """A tiny-llama Tessera checkpoint `root/step_00000000`."""
    return save_model_checkpoint(Transformer(get_preset("tiny-llama"), init_seed=0), root)


def rewrite_checksum(checkpoint: Path, name: str) -> None:
    """Record `name`'s current size and checksum in meta.json, as an attacker would."""
    meta = json.loads((checkpoint / ckpt.META).read_text())
    meta["files"][name] = file_digest(checkpoint / name)
    (checkpoint / ckpt.META).write_text(json.dumps(meta))


def plant_code_in_metadata(checkpoint: Path, marker: Path) -> None:
    """Replace DCP's `.metadata` with a pickle that creates `marker` when unpickled."""
    (checkpoint / ckpt.DCP_METADATA).write_bytes(pickle.dumps(RunsShellCommand(f"touch {marker}")))
    rewrite_checksum(checkpoint, ckpt.DCP_METADATA)

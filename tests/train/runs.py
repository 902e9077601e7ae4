"""Shared by the trainer and CLI tests: a small real dataset on disk and shrunken tiny configs."""

from __future__ import annotations

import json
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

from tessera.data import default_tokenizer, preprocess
from tests.hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]
TINY_DENSE = str(ROOT / "configs" / "tiny-dense.yaml")
TINY_MOE = str(ROOT / "configs" / "tiny-moe.yaml")
TINY_DEEPSEEK = str(ROOT / "configs" / "tiny-deepseek.yaml")
STDLIB_FILES = ("json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py")


def build_small_dataset(directory: Path) -> str:
    """~30k tokens of real Python source (a few stdlib modules), tokenized with the bundled tokenizer."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = directory / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": (stdlib / f).read_text()}) + "\n" for f in STDLIB_FILES))
    prefix = directory / "small"
    preprocess([docs], prefix, default_tokenizer(), show_progress=False)
    return str(prefix)


def shrink(dataset: str, run_dir: Path | str, steps: int, **extra: object) -> list[str]:
    """--set overrides that turn a tiny config into a seconds-long run on `dataset`, on the CPU (the
    suite's parent process forks ranks, so it must never initialise CUDA: tests/conftest.py)."""
    values: dict[str, object] = {
        "run_dir": str(run_dir), "train.steps": steps, "train.device": "cpu",
        "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128,
        "model.max_seq_len": 64, "train.seq_len": 32, "train.micro_batch_size": 2, "train.global_batch_size": 4,
        "train.log_interval": 1, "train.eval_interval": 0, "optim.warmup_steps": 2, "optim.total_steps": 20,
        "checkpoint.interval": 2, "log.tensorboard": False, "log.progress_bar": False,
        "data.datasets": f"[{{path: {dataset}}}]",
    }
    values.update(extra)
    out = []
    for key, value in values.items():
        text = json.dumps(value) if isinstance(value, bool) else str(value)
        out.append(f"{key}={text}")
    return out


def moe_shrink(dataset: str, run_dir: Path | str, steps: int, **extra: object) -> list[str]:
    return shrink(dataset, run_dir, steps, **{"model.moe.ffn_dim": 32, "model.moe.num_experts": 4, **extra})


def deepseek_shrink(dataset: str, run_dir: Path | str, steps: int, **extra: object) -> list[str]:
    """Layer 0 dense, layer 1 MoE; MLA has no kv-head count, so n_kv_heads stays n_heads."""
    return shrink(dataset, run_dir, steps, **{"model.n_kv_heads": 4, "model.moe.ffn_dim": 32,
                                              "model.moe.shared_ffn_dim": 32, **extra})


def set_args(overrides: list[str]) -> list[str]:
    """The overrides as command-line arguments."""
    return [a for o in overrides for a in ("--set", o)]


def read_losses(run_dir: Path | str) -> dict[int, float]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def sigterm_after_two_logged_steps(proc: subprocess.Popen, run: Path | str) -> int:
    """Wait until `run` has logged two steps, send SIGTERM, wait for the exit; returns the last
    logged step (the run is expected to have saved exactly that step before exiting)."""
    metrics = Path(run) / "metrics.jsonl"
    try:
        deadline = time.monotonic() + HANG_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    return max(read_losses(run))

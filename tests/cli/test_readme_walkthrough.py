"""Every command of the README's ```bash blocks runs as written, in order, in a fresh copy of the
checkout (configs/ and examples/; the package itself is imported from this tree), and after them the
guides' recipes the README names and links to instead of printing them (GUIDE_BLOCKS).

What the walk-through changes, so that it takes a minute instead of hours:
- every `tessera train` gets `--set` overrides appended (they win over the README's own): two steps
  of a shrunken model (dim 64, 4 heads, 4 layers kept so that pp=2 x vpp=2 still divides them) on
  short sequences, no TensorBoard; runs that would read the bundled corpus read a few stdlib modules
  instead (preparing the whole corpus takes half a minute; tests/train/test_bundled_corpus.py
  covers that);
- `tessera serve ... &` starts a real server in the background on a free port instead of 8000,
  and the `curl` that follows asks that port; the server is stopped when the next one starts, and
  at the end;
- `make` (the whole setup), `torchrun` and `sbatch` (clusters) are not run.
`tessera` commands run in this process through `tessera.cli.main` (a process per command would cost
seconds of imports each), except `serve` and the ranks `--nproc` starts, which are processes.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tessera.cli import main
from tests.hang_guard import HANG_S
from tests.infer.running_server import free_port, wait_until_serving
from tests.train.runs import ROOT, build_small_dataset

TESSERA = ".venv/bin/tessera"
NOT_RUN = ("make", "torchrun", "sbatch")
SMALL_MODEL = {"train.steps": 2, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128,
               "model.max_seq_len": 64, "train.seq_len": 32, "train.eval_steps": 1, "log.tensorboard": "false",
               "log.progress_bar": "false", "checkpoint.interval": 0, "train.device": "cpu"}
SMALL_MOE = {"model.moe.ffn_dim": 32}
# MLA has no kv-head count (n_kv_heads stays n_heads); the shared expert shrinks with the routed ones
SMALL_DEEPSEEK = {"model.moe.ffn_dim": 32, "model.moe.shared_ffn_dim": 32, "model.n_kv_heads": 4}


# (guide, heading): the first ```bash block after the heading, run after the README's blocks, in this
# order (they use the runs and data the README's commands made)
GUIDE_BLOCKS = (("docs/training.md", "## LoRA and QLoRA"),
                ("docs/training.md", "## Preference optimization (DPO)"),
                ("docs/training.md", "## Reinforcement learning on rewards (GRPO)"),
                ("docs/training.md", "## Knowledge distillation"))


def readme_commands(text: str) -> list[str]:
    """The commands of every ```bash block, continuation lines joined, comment lines dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(command)
    return commands


def walkthrough_commands() -> list[str]:
    """The README's commands, then those of each of GUIDE_BLOCKS."""
    commands = readme_commands((ROOT / "README.md").read_text())
    for guide, heading in GUIDE_BLOCKS:
        text = (ROOT / guide).read_text()
        commands += readme_commands(re.search(r"```bash\n.*?```", text[text.index(heading):], re.S).group(0))
    return commands


def _shell_words(command: str) -> list[str]:
    """The words bash would pass: quotes removed, comments dropped, globs expanded (in the cwd)."""
    words = []
    for word in shlex.split(command, comments=True):
        matches = sorted(glob.glob(word)) if any(c in word for c in "*?[") else []  # no match: kept, as bash does
        words.extend(matches or [word])
    return words


def _train_overrides(words: list[str], dataset: str) -> list[str]:
    values = dict(SMALL_MODEL)
    if "tiny-moe" in words[2]:
        values.update(SMALL_MOE)
    if "tiny-deepseek" in words[2]:
        values.update(SMALL_DEEPSEEK)
    if not any(w.startswith("data.datasets=") for w in words):
        values["data.datasets"] = f"[{{path: {dataset}}}]"
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def test_readme_commands_find_their_runner():
    commands = walkthrough_commands()
    assert len(commands) >= 15
    for command in commands:
        assert shlex.split(command)[0] in (TESSERA, "curl", *NOT_RUN), command


@pytest.mark.slow
def test_every_readme_command_runs_in_order(tmp_path, monkeypatch, capsys):
    dataset = build_small_dataset(tmp_path)
    work = tmp_path / "checkout"
    work.mkdir()
    for folder in ("configs", "examples"):
        shutil.copytree(ROOT / folder, work / folder)
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # for the processes --nproc and serve start
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port: int | None = None  # chosen when the first command names it: training's gloo sockets come before
    server: subprocess.Popen | None = None
    ran: list[str] = []
    try:
        for command in walkthrough_commands():
            if "8000" in command:
                port = port or free_port()
                command = command.replace("8000", str(port))
            words = _shell_words(command)
            if words[0] in NOT_RUN:
                continue
            if words[0] == "curl":
                assert server is not None, "curl before tessera serve"
                wait_until_serving(server, f"http://127.0.0.1:{port}", timeout=HANG_S)
                out = subprocess.run(words, capture_output=True, text=True, timeout=HANG_S)
                assert out.returncode == 0, (command, out.stderr)
                answer = json.loads(out.stdout)
                assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] > 0, out.stdout
                ran.append(command)
                continue
            assert words[0] == TESSERA, command
            args = words[1:]
            if args[-1] == "&":
                assert args[0] == "serve", command
                if server is not None:  # a later server takes the port: the earlier one is done
                    server.terminate()
                    server.wait(HANG_S)
                server = subprocess.Popen([sys.executable, "-m", "tessera", *args[:-1], "--log-level", "warning"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env={**os.environ})
                ran.append(command)
                continue
            if args[0] == "train":
                args += _train_overrides(words, dataset)
            if args[0] == "eval":  # a HuggingFace directory's loss is built with train.device=auto
                args += ["--set", "train.device=cpu"]
            status = main(args)
            out, err = capsys.readouterr()
            assert status == 0, f"{command}\nexit {status}\n{err[-3000:]}"
            ran.append(command)
        assert server is not None and any(c.startswith("curl") for c in ran)
        assert sum(" train " in f" {c} " for c in ran) >= 7 and any("--nproc 4" in c for c in ran)
        # The Minitron recipe did what it says: 4 layers kept, and the pruned model trained against its teacher
        assert json.loads((work / "runs/tiny-dense-4l/config.json").read_text())["num_hidden_layers"] == 4
        steps = [json.loads(line) for line in (work / "runs/tiny-dense-4l-kd/metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "loss" in r]
        assert steps and all(r["distill_loss"] > 0 for r in steps), steps
    finally:
        if server is not None:
            server.terminate()
            server.wait(HANG_S)

"""`tessera train --nproc N --max-restarts K` and torchrun's `--max-restarts`: a job whose rank dies is
started again from its newest good checkpoint, logs each restart with its cause, keeps one metrics
line per step, and ends with the weights an uninterrupted run has; a failure that repeats at the same
step stops the job instead of looping."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tessera.checkpoint.dcp import store as ckpt
from tessera.cli import main
from tessera.parallel.jobs.events import read_events
from tests.hang_guard import HANG_S
from tests.train.runs import ROOT, TINY_DENSE, read_losses, set_args, shrink

FSDP4 = {"parallel.dp_shard": 4, "train.micro_batch_size": 1, "optim.eps": 1e-3}
FSDP2 = {"parallel.dp_shard": 2, "optim.eps": 1e-3}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _final_state(run: Path, scratch: Path) -> dict:
    """Every tensor and object of the run's last checkpoint, read by DCP's own converter."""
    latest = ckpt.find_latest(run / "checkpoints")
    assert latest is not None
    dcp_to_torch_save(latest, scratch)
    return _flat(torch.load(scratch, weights_only=False))


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, key


class _Job:
    """A launcher started as a subprocess, its stderr collected by a thread."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def ranks(self) -> list[int]:
        """The pids of the launcher's children (its ranks), from /proc."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
        return pids

    def finish(self) -> int:
        try:
            status = self.proc.wait(timeout=HANG_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=HANG_S)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return status

    def text(self) -> str:
        return "".join(self.lines)


def _logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:
            continue
    return steps


def _kill_at(job: _Job, run: Path, step: int, restarts: int, rng: random.Random) -> int:
    """Once the attempt after `restarts` restarts has logged `step`, SIGKILL one of its ranks at random;
    returns the rank's pid. (Lines the previous attempt logged before it was killed are of earlier steps.)"""
    deadline = time.monotonic() + HANG_S
    while not (job.text().count("tessera train: restart ") >= restarts and max(_logged_steps(run), default=0) >= step):
        assert job.proc.poll() is None, job.text()[-3000:]
        assert time.monotonic() < deadline, job.text()[-3000:]
        time.sleep(0.02)
    victim = rng.choice(sorted(job.ranks()))
    os.kill(victim, signal.SIGKILL)
    return victim


@pytest.mark.dist
@pytest.mark.slow
def test_ranks_killed_at_random_steps_restart_and_end_bit_identical(small_dataset, tmp_path):
    """SIGKILL a random rank of a 4-rank FSDP job at three random steps: the job restarts itself each
    time from the newest good checkpoint (written in the background: checkpoint.async), finishes, logs
    each step once with the loss of an uninterrupted run, and its final checkpoint (weights, Adam's
    moments, data position, every rank's RNG) equals that run's bit for bit."""
    seed = int(os.environ.get("TESSERA_TEST_SEED", random.randrange(2**31)))
    print(f"TESSERA_TEST_SEED={seed}")  # shown with a failure, a hang-guard timeout's included
    rng = random.Random(seed)
    steps, interval = 12, rng.choice([1, 2])
    # Kills two or more steps apart: a rank is killed during the step it was seen to log or the next,
    # so no failure lands on the step of the previous one (which would stop the job, by design).
    kills = [rng.randint(2, 3)]
    while len(kills) < 3:
        kills.append(kills[-1] + rng.randint(2, 3))
    run, reference = tmp_path / "run", tmp_path / "reference"
    common = {**FSDP4, "checkpoint.interval": interval, "checkpoint.keep_last": 2}
    job = _Job(["tessera", "train", TINY_DENSE, *set_args(shrink(small_dataset, run, steps, **common,
                                                                 **{"checkpoint.async": True})),
                "--nproc", "4", "--max-restarts", "5"])
    killed = [_kill_at(job, run, step, i, rng) for i, step in enumerate(kills)]
    status = job.finish()
    context = f"seed {seed}, kills at {kills}, interval {interval}:\n{job.text()[-4000:]}"
    assert status == 0, context
    restarts = read_events(run, "restart")
    assert [e["restart"] for e in restarts] == [1, 2, 3], context
    assert all(e["cause"] == "was killed by SIGKILL" and e["step"] is not None for e in restarts), restarts
    assert job.text().count("tessera train: restart ") == 3 and len(set(killed)) == 3, context
    assert "Traceback" not in job.text(), context

    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, reference, steps, **common)),
                 "--nproc", "4"]) == 0
    assert _logged_steps(run) == list(range(1, steps + 1)), context  # each step once
    assert read_losses(run) == read_losses(reference), context
    _assert_same_state(_final_state(run, tmp_path / "a.pt"), _final_state(reference, tmp_path / "b.pt"))


@pytest.mark.dist
@pytest.mark.slow
def test_a_killed_rank_is_one_line_in_the_jobs_output_not_a_traceback(small_dataset, tmp_path):
    """SIGKILL one rank of two: the other fails under the collective it shared with the dead one. That
    consequence is one line naming the phase; the cause is the launcher's restart line (its event in
    events.jsonl); the job's output holds no traceback, and the restarted job finishes."""
    run = tmp_path / "run"
    job = _Job(["tessera", "train", TINY_DENSE, *set_args(shrink(small_dataset, run, 6, **FSDP2,
                                                                 **{"checkpoint.interval": 2})),
                "--nproc", "2", "--max-restarts", "1"])
    _kill_at(job, run, 3, 0, random.Random(0))
    assert job.finish() == 0, job.text()[-3000:]
    text = job.text()
    assert "Traceback" not in text, text[-6000:]
    [restart] = read_events(run, "restart")
    assert restart["cause"] == "was killed by SIGKILL", restart
    assert text.count(f"tessera train: restart 1 of 1: rank {restart['rank']} was killed by SIGKILL") == 1, text
    survivor = [line for line in text.splitlines() if "another rank of the job ended" in line]
    assert len(survivor) <= 1 and all(line.startswith("tessera train: error: [rank ") for line in survivor), text


def test_a_peer_lost_under_a_collective_is_a_one_line_error():
    """gloo's error in the rank that outlived its peer becomes a TrainingError naming the phase, which
    the launcher still counts as a consequence of another rank's failure, not as the cause."""
    from tessera.config.errors import TrainingError
    from tessera.parallel.jobs.collective_timeout import collective_phase, lost_peer
    from tessera.parallel.jobs.restarts import RankExit, failing_rank

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:24968: Connection reset by peer")
    with pytest.raises(TrainingError, match="another rank of the job ended during forward/backward") as caught:
        with collective_phase("forward/backward", 0, 2, 30.0):
            raise gloo
    assert "\n" not in str(caught.value) and "Connection reset by peer" in str(caught.value)
    assert lost_peer(gloo, 0, 1) is None and lost_peer(RuntimeError("CUDA out of memory"), 0, 2) is None
    assert lost_peer(caught.value, 0, 2) is None  # already said
    survivor = RankExit(0, 1, 4, f"TrainingError: {caught.value}")
    assert survivor.peer_caused and failing_rank([survivor, RankExit(1, 3, 4, "ValueError: bad")]).rank == 1


@pytest.mark.dist
@pytest.mark.slow
def test_a_failure_that_repeats_at_the_same_step_stops_the_job(small_dataset, tmp_path):
    """lr=1e5 makes the gradient of step 4 NaN, every time; with train.skip_nonfinite=false every rank
    stops there. One restart resumes from step 2 and fails at step 4 again: the launcher gives up with
    the reason (status 1) instead of spending its other restarts."""
    run = tmp_path / "run"
    diverge = {**FSDP2, "optim.lr": "1e5", "optim.min_lr": 0, "optim.warmup_steps": 0, "train.grad_clip": 0,
               "train.skip_nonfinite": False, "checkpoint.interval": 2}
    job = _Job(["tessera", "train", TINY_DENSE, *set_args(shrink(small_dataset, run, 8, **diverge)),
                "--nproc", "2", "--max-restarts", "3"])
    assert job.finish() == 1, job.text()[-3000:]
    events = [e for e in read_events(run) if e["event"].startswith("restart")]  # a loaded machine adds stragglers
    assert [e["event"] for e in events] == ["restart", "restart_refused"], events
    assert events[0]["step"] == events[1]["step"] == 4 and events[1]["reason"] == "repeated at the same step"
    assert "train.skip_nonfinite=false" in events[0]["cause"], events
    assert "where the previous attempt failed too" in job.text() and job.text().count("restart 1 of 3") == 1
    assert ckpt.read_meta(ckpt.find_latest(run / "checkpoints"))["step"] == 2  # nothing after the failure


def test_max_restarts_needs_the_launcher(small_dataset, tmp_path, capsys):
    overrides = shrink(small_dataset, tmp_path / "run", 2)
    assert main(["train", TINY_DENSE, *set_args(overrides), "--max-restarts", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-restarts=2 is invalid without --nproc" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_restarts_resume_from_the_newest_good_checkpoint(small_dataset, tmp_path):
    """Under torchrun's own --max-restarts, the ranks it starts again (TORCHELASTIC_RESTART_COUNT > 0)
    resume on their own, as `--resume` would: one metrics line per step, the losses and final weights
    of an uninterrupted run."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    run, reference = tmp_path / "run", tmp_path / "reference"
    common = {**FSDP2, "checkpoint.interval": 2}
    job = _Job(["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                "-m", "tessera", "train", TINY_DENSE, *set_args(shrink(small_dataset, run, 6, **common))])
    _kill_at(job, run, 3, 0, random.Random(0))
    assert job.finish() == 0, job.text()[-3000:]
    assert "restart 1)" in job.text()  # "resuming from .../step_N (step N, restart 1)"
    assert main(["train", TINY_DENSE, *set_args(shrink(small_dataset, reference, 6, **common)), "--nproc", "2"]) == 0
    assert _logged_steps(run) == list(range(1, 7))
    assert read_losses(run) == read_losses(reference)
    _assert_same_state(_final_state(run, tmp_path / "a.pt"), _final_state(reference, tmp_path / "b.pt"))

"""`make demo`'s training step on a shared machine: idle, and with N busy processes beside it, under
each OpenMP wait policy (tessera/cli/threads.py) and thread-count policy (tessera/cli/adaptive_threads.py).

    python bench/shared_cpu.py [--load 6 --steps 8 --policies spin10k,adaptive,one --sessions one,same --out FILE]

Each run is a fresh `python -m tessera train configs/tiny-moe.yaml` with the Makefile's demo
settings (OMP_NUM_THREADS=2, seq_len 128) for `--steps` steps, logged every step; its step time is
the median of steps 2.. (the first pays for the allocator and the data). The policies are
environments, each at a fixed two threads (train.adaptive_threads=false): libgomp (GOMP_SPINCOUNT=300000,
libgomp's own default, which `tessera` would otherwise replace), passive (OMP_WAIT_POLICY=PASSIVE,
`tessera`'s setting before), spin10k (a bounded spin, GOMP_SPINCOUNT=10000, what `tessera` sets). Beside
them, with the bounded spin: adaptive (`tessera train`'s default: two threads, one while other processes
keep the cores busy, chosen every 4 steps; each step's count is in the results) and one (one thread
throughout, OMP_NUM_THREADS=1: what the adaptive policy falls back to). The load is `--load` processes
each spinning a Python loop, started before the policies' runs and stopped after, placed by `--sessions`:
one session of their own (another user's or terminal's job), this session (as the figures before
2026-11-30 ran), or each its own; `spinners()` says why the placement matters. The machine's own load is
measured, not assumed: the mean number of runnable tasks (/proc/loadavg's fourth field) sampled every
0.5 s during each run, and the 1-minute load average at its end. The policies alternate within each
condition, and with `--rounds R` the whole sequence (idle, then each placement) repeats R times (the
medians over rounds printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPIN10K = {"GOMP_SPINCOUNT": "10000"}
# policy -> (environment, OMP_NUM_THREADS, train.adaptive_threads)
POLICIES = {"libgomp": ({"GOMP_SPINCOUNT": "300000"}, 2, False), "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2, False),
            "spin10k": (SPIN10K, 2, False), "adaptive": (SPIN10K, 2, True), "one": (SPIN10K, 1, False)}
DEMO = ["train.seq_len=128", "optim.lr=2e-3", "optim.warmup_steps=10", "train.eval_interval=0",
        "checkpoint.interval=0", "train.log_interval=1", "log.tensorboard=false", "log.progress_bar=false"]


def _runnable() -> int:
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])


class LoadSampler:
    """Runnable tasks sampled every 0.5 s while it is open."""

    def __init__(self):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append(_runnable())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_demo(policy: str, steps: int, run_dir: Path) -> dict:
    wait, threads, adaptive = POLICIES[policy]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(wait, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    sets = [a for s in [f"run_dir={run_dir}", f"train.steps={steps}", f"optim.total_steps={steps}", *DEMO,
                        f"train.adaptive_threads={str(adaptive).lower()}"] for a in ("--set", s)]
    cpu_start = os.times()
    start = time.perf_counter()
    with LoadSampler() as sampler:
        subprocess.run([sys.executable, "-m", "tessera", "train", "configs/tiny-moe.yaml", *sets], cwd=ROOT, env=env,
                       check=True, capture_output=True)
    wall = time.perf_counter() - start
    cpu = os.times()
    cpu_s = cpu.children_user + cpu.children_system - cpu_start.children_user - cpu_start.children_system
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = 16 * 128  # the config's global batch x the demo's sequence
    step_s = [tokens / r["tokens_per_s"] for r in records if r["step"] >= 2]
    return {"policy": policy, "step_s": statistics.median(step_s) if step_s else None, "steps_s": step_s,
            "threads": [r.get("cpu_threads") for r in records], "wall_s": wall, "cpu_s": cpu_s,
            "runnable_mean": statistics.mean(sampler.samples) if sampler.samples else None,
            "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0])}


SPIN = "while True: pass"
FORK_THEN_SPIN = "import os, sys\nfor _ in range(int(sys.argv[1]) - 1):\n    if os.fork() == 0:\n        break\n" + SPIN


def spinners(n: int, sessions: str) -> list[subprocess.Popen]:
    """`n` busy processes: in this process's session (`same`, as the bench ran before), all in one session of their
    own (`one`: another user's or terminal's job of n processes), or each in its own (`each`). Linux shares the cores
    between sessions before it shares them between threads (the scheduler's autogroups, on by default), so where the
    load runs decides the demo's share of the cores: 2/(n + its threads) in `same`, about 1/2 in `one`, 2/(n + 1) in
    `each`, whatever its thread count."""
    if n == 0:
        return []
    if sessions == "one":
        return [subprocess.Popen([sys.executable, "-c", FORK_THEN_SPIN, str(n)], start_new_session=True)]
    return [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=sessions == "each") for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Each busy process, and in `one` the processes it forked (its process group)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
        except ProcessLookupError:
            pass
        p.wait()


def one_round(policies: list[str], load: int, placements: list[str], steps: int, tmp: Path, round_: int) -> list[dict]:
    """Every policy idle, then every policy beside `load` busy processes in each placement (started before, stopped
    after)."""
    results = []
    for condition, busy, sessions in (("idle", 0, "-"), *(("loaded", load, p) for p in placements)):
        procs = spinners(busy, sessions)
        try:
            time.sleep(2 if busy else 0)
            for policy in policies:
                r = run_demo(policy, steps, tmp / f"{round_}-{condition}-{sessions}-{policy}")
                r.update(condition=condition, busy_processes=busy, sessions=sessions, round=round_)
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            stop(procs)
    return results


def summary(results: list[dict], policies: list[str], placements: list[str]) -> None:
    """Per policy the medians over rounds: the idle s/step, and for each placement of the load the loaded s/step,
    its ratio to the policy's own idle step and to spin10k's (the fixed two threads `tessera` ran before the
    adaptive policy), with the runnable tasks measured."""
    def med(policy: str, sessions: str, key: str) -> float:
        return statistics.median(r[key] for r in results if r["policy"] == policy and r["sessions"] == sessions)

    base = med("spin10k", "-", "step_s") if "spin10k" in policies else None
    print(f"{'policy':<10} {'load in':<8} {'idle s/step':>12} {'loaded s/step':>14} {'loaded/idle':>12} "
          f"{'/spin10k idle':>14} {'runnable idle':>14} {'runnable loaded':>16}")
    for sessions in placements:
        for policy in policies:
            idle, loaded = med(policy, "-", "step_s"), med(policy, sessions, "step_s")
            to_base = f"{loaded / base:>14.2f}" if base else f"{'-':>14}"
            print(f"{policy:<10} {sessions:<8} {idle:>12.2f} {loaded:>14.2f} {loaded / idle:>12.2f} {to_base} "
                  f"{med(policy, '-', 'runnable_mean'):>14.1f} {med(policy, sessions, 'runnable_mean'):>16.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=6, help="busy processes beside the loaded runs (6: load 8 counted "
                                                        "with the demo's two threads)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per run (timed: 2..)")
    ap.add_argument("--policies", default="spin10k,adaptive,one", help=f"of {','.join(POLICIES)}")
    ap.add_argument("--sessions", default="one", help="where the busy processes run, a list of: same (this "
                    "session), one (one of their own), each (each its own); spinners() says why it matters")
    ap.add_argument("--rounds", type=int, default=1, help="idle-then-loaded sequences, one after another")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    policies, placements = args.policies.split(","), args.sessions.split(",")
    bad = [p for p in policies if p not in POLICIES] + [p for p in placements if p not in ("same", "one", "each")]
    if bad:
        ap.error(f"unknown policy or placement {bad}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        run_demo("one", 1, Path(tmp) / "warm")  # the bundled corpus tokenized once, outside the timings
        for round_ in range(args.rounds):
            results += one_round(policies, args.load, placements, args.steps, Path(tmp), round_)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.steps} steps per run, "
          f"{args.rounds} round(s), {args.load} busy processes when loaded, sessions: {args.sessions}")
    summary(results, policies, placements)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

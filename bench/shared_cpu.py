"""`make demo`'s training step on a shared machine: idle, and with N busy processes beside it, under
each OpenMP wait policy (tessera/cli/threads.py).

    python bench/shared_cpu.py [--load 8 --steps 4 --policies libgomp,passive,spin10k --out FILE]

Each run is a fresh `python -m tessera train configs/tiny-moe.yaml` with the Makefile's demo
settings (OMP_NUM_THREADS=2, seq_len 128) for `--steps` steps, logged every step; its step time is
the median of steps 2.. (the first pays for the allocator and the data). The policies are
environments: libgomp (GOMP_SPINCOUNT=300000, libgomp's own default, which `tessera` would otherwise
replace), passive (OMP_WAIT_POLICY=PASSIVE, `tessera`'s setting before), spin10k (a bounded spin,
GOMP_SPINCOUNT=10000, what `tessera` sets). The load is `--load` processes each spinning a Python
loop, started before the policies' runs and stopped after; the machine's own load is measured, not
assumed: the mean number of runnable tasks (/proc/loadavg's fourth field) sampled every 0.5 s during
each run, and the 1-minute load average at its end. The policies alternate within each condition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"libgomp": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "spin10k": {"GOMP_SPINCOUNT": "10000"}}
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
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(POLICIES[policy], OMP_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    sets = [a for s in [f"run_dir={run_dir}", f"train.steps={steps}", f"optim.total_steps={steps}", *DEMO]
            for a in ("--set", s)]
    start = time.perf_counter()
    with LoadSampler() as sampler:
        subprocess.run([sys.executable, "-m", "tessera", "train", "configs/tiny-moe.yaml", *sets], cwd=ROOT, env=env,
                       check=True, capture_output=True)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = 16 * 128  # the config's global batch x the demo's sequence
    step_s = [tokens / r["tokens_per_s"] for r in records if r["step"] >= 2]
    return {"policy": policy, "step_s": statistics.median(step_s) if step_s else None, "steps_s": step_s,
            "wall_s": wall,
            "runnable_mean": statistics.mean(sampler.samples) if sampler.samples else None,
            "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0])}


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=8, help="busy processes beside the loaded runs")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (timed: 2..)")
    ap.add_argument("--policies", default="libgomp,passive,spin10k")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    policies = args.policies.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        run_demo("passive", 1, Path(tmp) / "warm")  # the bundled corpus tokenized once, outside the timings
        for condition, load in (("idle", 0), ("loaded", args.load)):
            procs = spinners(load)
            try:
                time.sleep(2 if load else 0)
                for policy in policies:
                    r = run_demo(policy, args.steps, Path(tmp) / f"{condition}-{policy}")
                    r.update(condition=condition, busy_processes=load)
                    results.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {args.steps} steps per run")
    print(f"{'policy':<10} {'idle s/step':>12} {'loaded s/step':>14} {'loaded/idle':>12} {'runnable idle':>14} "
          f"{'runnable loaded':>16}")
    for policy in policies:
        idle = next(r for r in results if r["policy"] == policy and r["condition"] == "idle")
        loaded = next(r for r in results if r["policy"] == policy and r["condition"] == "loaded")
        ratio = loaded["step_s"] / idle["step_s"]
        print(f"{policy:<10} {idle['step_s']:>12.2f} {loaded['step_s']:>14.2f} {ratio:>12.2f} "
              f"{idle['runnable_mean']:>14.1f} {loaded['runnable_mean']:>16.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Speculative decoding with a model's own MTP module and with an EAGLE-3 head vs no speculation vs
prompt lookup, on CPU.

    python bench/mtp.py [--steps 300] [--eagle-steps 300] [--k 1 2 4] [--tokens 64] [--repeats 3]

1. Trains a small dense target with `model.mtp_depth=1` on the bundled corpus (Python standard
   library source, the bundled tokenizer) through the `tessera train` command, one process; then
   (with `--eagle-steps` > 0) an EAGLE-3 draft head against that frozen target on the same corpus,
   through `tessera train --set train.eagle.target=RUN`.
2. Serves the run in this process (`LLM`, the serving engine) four ways: no speculation, prompt
   lookup with k=4, `speculative.method="mtp"` and `"eagle"` (the head just trained) with each
   `--k`; greedy decoding of `--tokens` tokens after prompts cut from standard-library files the
   corpus does not hold (its tests), at batch 1 and 8.
3. Prints one JSON object: per configuration and batch size, the generated tokens per second
   (prefill included, median of `--repeats`), its ratio to no speculation, and for the speculative
   ones the mean tokens emitted per verification step (accepted drafts + 1) and the acceptance
   rate, plus the runs' last logged losses (mtp_loss; the EAGLE head's loss and step-0 argmax
   agreement with the target) and the load average. Every configuration's output is checked to
   equal the unspeculated one (greedy).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.data.corpus import stdlib_root  # noqa: E402
from tessera.infer import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

MODEL = ("model.dim=192", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=512",
         "model.mtp_depth=1")
TRAIN = ("train.device=cpu", "train.seq_len=128", "train.micro_batch_size=8", "train.global_batch_size=8",
         "log.tensorboard=false", "log.progress_bar=false", "train.eval_interval=0", "train.log_interval=25",
         "optim.lr=2e-3", "optim.min_lr=2e-4", "optim.warmup_steps=20")


def train(run: Path, steps: int) -> dict:
    sets = [*MODEL, *TRAIN, f"train.steps={steps}", f"checkpoint.interval={steps}", f"run_dir={run}"]
    cmd = [sys.executable, "-m", "tessera", "train", str(ROOT / "configs" / "tiny-dense.yaml")]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    return {"steps": steps, "seconds": round(time.perf_counter() - start, 1), "loss": last["loss"],
            "mtp_loss": last["mtp_loss"], "command": " ".join(cmd[1:])}


def train_eagle(run: Path, eagle_run: Path, steps: int, unroll: int) -> dict:
    """An EAGLE-3 head against the frozen target `run`, on the bundled corpus (its batch and schedule
    as the target's; the draft's width and heads are the target's)."""
    sets = [*TRAIN, f"train.steps={steps}", f"run_dir={eagle_run}", f"train.eagle.target={run}",
            f"train.eagle.unroll={unroll}", "optim.lr=3e-3", "optim.min_lr=3e-4"]
    cmd = [sys.executable, "-m", "tessera", "train", str(ROOT / "configs" / "tiny-dense.yaml")]
    for s in sets:
        cmd += ["--set", s]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    last = [json.loads(line) for line in (eagle_run / "metrics.jsonl").read_text().splitlines()][-1]
    return {"steps": steps, "seconds": round(time.perf_counter() - start, 1), "loss": last["loss"],
            "acc_step0": last["eagle_acc/0"], "command": " ".join(cmd[1:])}


def prompts(n: int, chars: int = 300) -> list[str]:
    """Openings of standard-library test files (the corpus skips test directories)."""
    files = sorted((stdlib_root() / "test").glob("test_*.py"))[:n]
    return [f.read_text(errors="replace")[:chars] for f in files]


def measure(run: Path, spec: SpeculativeConfig | None, texts: list[str], batch: int, tokens: int,
            repeats: int) -> dict:
    llm = LLM(run, block_size=16, max_num_seqs=max(batch, 8), enable_prefix_caching=False, speculative=spec)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rates, outputs = [], None
    for _ in range(repeats):
        before = (llm.engine.metrics.spec_proposed, llm.engine.metrics.spec_accepted)
        start = time.perf_counter()
        outs = []
        for i in range(0, len(texts), batch):
            outs += llm.generate(texts[i:i + batch], params)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        outputs = [o.token_ids for o in outs]
    m = llm.engine.metrics
    out = {"tokens_per_s": round(statistics.median(rates), 1), "outputs": outputs}
    if spec is not None:
        proposed, accepted = m.spec_proposed - before[0], m.spec_accepted - before[1]
        out.update(acceptance_rate=round(accepted / max(proposed, 1), 3),
                   tokens_per_step=round(m.tokens_per_step, 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eagle-steps", type=int, default=300, help="EAGLE head training steps (0: no EAGLE rows)")
    ap.add_argument("--eagle-unroll", type=int, default=3, help="its training-time-test steps")
    ap.add_argument("--run", default=None, help="an already trained run directory (skips training)")
    ap.add_argument("--eagle", default=None, help="an already trained EAGLE draft directory (skips its training)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.run) if args.run else Path(tmp) / "run"
        result: dict = {"machine": f"{platform.processor() or platform.machine()}, {platform.system()}, "
                                   f"{os.cpu_count()} cores", "load_average_before": os.getloadavg(),
                        "train": train(run, args.steps) if not args.run else {"run": str(run)}}
        draft = args.eagle
        if draft is None and args.eagle_steps > 0:
            result["train_eagle"] = train_eagle(run, Path(tmp) / "eagle", args.eagle_steps, args.eagle_unroll)
            draft = str(Path(tmp) / "eagle" / "draft")
        texts = prompts(args.prompts)
        configs = {"none": None, "prompt_lookup_k4": SpeculativeConfig(method="prompt_lookup", num_tokens=4)}
        configs.update({f"mtp_k{k}": SpeculativeConfig(method="mtp", num_tokens=k) for k in args.k})
        if draft is not None:
            configs.update({f"eagle_k{k}": SpeculativeConfig(method="eagle", num_tokens=k, draft_model=draft)
                            for k in args.k})
        for batch in (1, 8):
            rows = {name: measure(run, spec, texts, batch, args.tokens, args.repeats) for name, spec in configs.items()}
            base = rows["none"]
            for name, row in rows.items():
                if name != "none":  # greedy: speculation changes the speed, never the tokens
                    assert row.pop("outputs") == base["outputs"], name
                row["ratio_vs_none"] = round(row["tokens_per_s"] / base["tokens_per_s"], 2)
            base.pop("outputs")
            result[f"batch_{batch}"] = rows
        result["load_average_after"] = os.getloadavg()
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

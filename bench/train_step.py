"""Training-step throughput: Tessera's trainer vs the same model in HuggingFace transformers.

    python bench/train_step.py [--configs configs/tiny-dense.yaml configs/tiny-moe.yaml] [--steps 5]

For each config, Tessera's `Trainer.train_step` (global batch, accumulation, AdamW, clipping,
schedule, MoE bias update) is timed on the bundled corpus. The peer is the same model exported with
`tessera.hf.save_pretrained` and loaded by `transformers.AutoModelForCausalLM`, trained by a
plain PyTorch loop on the same batches with the same micro-batching, loss normalisation, AdamW and
clipping (for MoE models HF's load-balancing loss is switched on with the same coefficient).
Both run in fp32 on the CPU in the same process, alternating step by step so that machine
load affects both alike. Prints one JSON object: tokens/s of each and the ratio Tessera / HF.

Parallel layouts: for each config, the same trainer also runs on two forked gloo ranks
(tests.forked_ranks.run_ranks, one intra-op thread per rank) under each layout of
`--layouts` (fsdp2, replicate2, tp2, tp2-sp, pp2-1f1b, and ep2-fsdp2 for MoE configs); the JSON
gets, per layout, the median step time and tokens/s of the whole global batch. They run first,
before this process computes anything, so that the forked ranks start from a process whose
OpenMP pool was never used. On a CPU with as many cores as ranks these figures say what the
collectives and the extra bookkeeping cost next to one process, not what a GPU cluster gains.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from tessera.config.schema import load_config  # noqa: E402
from tessera.hf import save_pretrained  # noqa: E402
from tessera.models.counting import count_params  # noqa: E402
from tessera.train.data_source import build_training_data  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402
from tests.forked_ranks import run_ranks  # noqa: E402


class HFLoop:
    """A plain training loop over a transformers model, doing the work of one Tessera step."""

    def __init__(self, trainer: Trainer, directory: Path):
        from transformers import AutoModelForCausalLM

        save_pretrained(trainer.model, directory)
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        moe = trainer.cfg.model.moe
        if moe is not None and moe.aux_loss_coef > 0:
            self.model.config.output_router_logits = True
            self.model.config.router_aux_loss_coef = moe.aux_loss_coef
        self.model.train()
        o = trainer.cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.cfg = trainer.cfg
        self.moe = moe is not None and moe.aux_loss_coef > 0

    def step(self, tokens: torch.Tensor) -> None:
        t = self.cfg.train
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        n_micro = t.global_batch_size // t.micro_batch_size
        n_tokens = targets.numel()
        for i in range(n_micro):
            rows = slice(i * t.micro_batch_size, (i + 1) * t.micro_batch_size)
            out = self.model(input_ids=inputs[rows])
            logits = out.logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets[rows].flatten(),
                                                     reduction="sum") / n_tokens
            if self.moe and getattr(out, "aux_loss", None) is not None:
                loss = loss + self.model.config.router_aux_loss_coef * out.aux_loss / n_micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench_config(path: str, overrides: list[str], steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(path, [f"run_dir={tmp}/run", "log.progress_bar=false", "log.tensorboard=false",
                                 "train.dtype=fp32", *overrides])
        trainer = Trainer(cfg)
        peer = HFLoop(trainer, Path(tmp) / "hf")
        batches = build_training_data(cfg).train  # the same seed: the batches Tessera's trainer draws
        tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
        times: dict[str, list[float]] = {"tessera": [], "hf": []}
        for i in range(warmup + steps):
            start = time.perf_counter()
            trainer.train_step()
            tessera_s = time.perf_counter() - start
            batch = batches.next_batch()
            start = time.perf_counter()
            peer.step(batch.tokens)
            hf_s = time.perf_counter() - start
            if i >= warmup:
                times["tessera"].append(tessera_s)
                times["hf"].append(hf_s)
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "config": str(Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path),
            "params": count_params(cfg.model), "active_params": count_params(cfg.model, active=True),
            "tokens_per_step": tokens_per_step,
            "tessera_tokens_per_s": tokens_per_step / med["tessera"],
            "hf_tokens_per_s": tokens_per_step / med["hf"],
            "ratio_tessera_over_hf": med["hf"] / med["tessera"],
            "step_seconds_median": med,
        }


WORLD = 2  # the layouts below are written for two ranks
LAYOUTS: dict[str, dict[str, object]] = {
    "fsdp2": {"parallel.dp_shard": 2},
    "replicate2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 1},
    "tp2": {"parallel.tp": 2, "parallel.dp_shard": 1},
    "tp2-sp": {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1},
    "pp2-1f1b": {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1f1b"},
    "ep2-fsdp2": {"parallel.ep": 2, "parallel.dp_shard": 2},  # MoE configs only
}


def _time_steps_on_rank(path: str, overrides: list[str], steps: int, warmup: int) -> float:
    """Runs on every rank: median seconds of one `train_step` (all ranks start and end it together)."""
    trainer = Trainer(load_config(path, overrides))
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_layouts(path: str, overrides: list[str], names: list[str], world: int, steps: int, warmup: int
                  ) -> list[dict]:
    """tokens/s of the trainer under each named layout on `world` forked gloo ranks."""
    out = []
    for name in names:
        layout = LAYOUTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(path, [f"run_dir={tmp}/run", *overrides])
            if name.startswith("ep") and not cfg.model.is_moe:
                continue
            sets = [f"run_dir={tmp}/run", "log.progress_bar=false", "log.tensorboard=false", "train.dtype=fp32",
                    "checkpoint.interval=0", *overrides, *(f"{k}={json.dumps(v)}" for k, v in layout.items())]
            seconds = run_ranks(_time_steps_on_rank, world, path, sets, steps, warmup, timeout=1800)[0]
        tokens = cfg.train.global_batch_size * cfg.train.seq_len
        out.append({"layout": name, "world": world, "parallel": layout, "step_seconds_median": seconds,
                    "tokens_per_s": tokens / seconds})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=[str(ROOT / "configs/tiny-dense.yaml"),
                                                     str(ROOT / "configs/tiny-moe.yaml")])
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--steps", type=int, default=5, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                   help="parallel layouts to time on forked ranks (none: skip them)")
    args = p.parse_args()
    # Forked ranks first: nothing in this process has used its thread pool yet.
    layouts = {c: bench_layouts(c, args.overrides, args.layouts, WORLD, args.steps, args.warmup)
               for c in args.configs}
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    result = {
        "benchmark": "train_step", "device": "cpu", "dtype": "fp32", "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": [bench_config(c, args.overrides, args.steps, args.warmup) for c in args.configs],
    }
    for entry, c in zip(result["results"], args.configs):
        entry["layouts"] = layouts[c]  # one intra-op thread per rank; the single-process figures use --threads
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

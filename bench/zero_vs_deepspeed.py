"""Sharded data parallel on CPU: Tessera (FSDP2 through `parallelize`) vs DeepSpeed ZeRO stage 2.

    OMP_NUM_THREADS=1 python bench/zero_vs_deepspeed.py [--config configs/tiny-dense.yaml] [--steps 6]

Both sides train the same `tessera.models.Transformer` (built on every rank from the same seed)
on two forked gloo ranks with one intra-op thread each (tests.forked_ranks.run_ranks), in
fp32, on the same random global batches (global_batch_size x seq_len tokens of the config, cut
into two contiguous row blocks, one per rank, one micro-batch per rank), with the same AdamW
(`tessera.train.optimizer.build_optimizer`: the config's betas, eps, decay groups; constant
learning rate `optim.lr`) and the same gradient clipping (`train.grad_clip`).

  Tessera     `parallelize` with dp_shard=2, zero_stage=2 (weights gathered once per step and kept
              for backward; gradients and optimizer state sharded); loss = token-loss sum over
              the global batch's token count, gradients summed across ranks (docs/architecture.md, "Numerics contract").
  DeepSpeed   `deepspeed.initialize` with ZeRO stage 2 on the CPU accelerator over gloo, the plain
              torch AdamW passed in (`zero_allow_untested_optimizer`), no compiled optimizer; loss =
              mean over the rank's tokens, which DeepSpeed averages across ranks: the same gradient.

Both trainers live in the same two ranks and take turns step by step (who goes first alternates),
so that machine load falls on both alike; every step is timed between barriers. The figures are
tokens/s at the median step of each side, their ratio, and the median of the per-step ratios.
As a check that both train the same thing, the global-batch loss of the first step (before any
update) and of the last step must agree (exit status 1 if not). Prints one JSON object: tokens/s
of each side, the ratios Tessera / DeepSpeed, losses, grad norms and the machine. Without
DeepSpeed installed it says so and exits 0 (DeepSpeed is a benchmark-only peer, not a dependency):

    DS_BUILD_OPS=0 pip install -c constraints.txt deepspeed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read by DeepSpeed at import: no CUDA probing

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tessera.config.parallel import ParallelConfig  # noqa: E402
from tessera.config.schema import RunConfig, load_config  # noqa: E402
from tessera.models import Transformer  # noqa: E402
from tessera.models.counting import count_params  # noqa: E402
from tessera.parallel import (  # noqa: E402
    ParallelDims,
    clip_grad_norm_,
    global_sum,
    parallelize,
    shard_global_batch,
)
from tessera.train.objectives.loss import token_loss_sum  # noqa: E402
from tessera.train.optimizer import build_optimizer  # noqa: E402
from tests.forked_ranks import run_ranks  # noqa: E402

WORLD = 2
INIT_SEED = 0


def global_batch(cfg: RunConfig, step: int) -> torch.Tensor:
    """Random token ids [global_batch_size, seq_len + 1] for `step`, the same on every rank and side."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1),
                         generator=g)


StepFn = Callable[[torch.Tensor], tuple[float, float]]  # global batch -> (global-batch loss, grad norm)


def tessera_trainer(cfg: RunConfig) -> StepFn:
    """FSDP2 ZeRO-2 over both ranks through `tessera.parallel.parallelize`; returns its step."""
    pcfg = ParallelConfig(dp_shard=WORLD, zero_stage=2)
    dims = ParallelDims.from_config(pcfg, WORLD)
    dims.validate(cfg.model, WORLD, seq_len=cfg.train.seq_len)
    dims.build_mesh("cpu")
    model = parallelize(Transformer(cfg.model, init_seed=INIT_SEED), dims, pcfg)
    opt = build_optimizer(model, cfg.optim)
    clip = cfg.train.grad_clip or float("inf")

    def step(batch: torch.Tensor) -> tuple[float, float]:
        inputs, targets = shard_global_batch(batch[:, :-1], dims), shard_global_batch(batch[:, 1:], dims)
        out = model(inputs)
        loss = token_loss_sum(out.logits, targets) / batch[:, 1:].numel() + out.aux_loss / WORLD
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), clip, dims)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return global_sum(loss, dims).item(), float(norm)

    return step


def deepspeed_config(cfg: RunConfig) -> dict:
    """ZeRO stage 2, fp32, the torch optimizer passed in; DeepSpeed's defaults for the rest."""
    return {
        "train_micro_batch_size_per_gpu": cfg.train.global_batch_size // WORLD,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.train.grad_clip or 0.0,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def deepspeed_trainer(cfg: RunConfig) -> StepFn:
    """DeepSpeed ZeRO-2 on the process group the harness already started; returns its step."""
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    rank = dist.get_rank()
    # DeepSpeed reads the launcher's variables; the group exists already, so no rendezvous happens.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    model = Transformer(cfg.model, init_seed=INIT_SEED)
    opt = build_optimizer(model, cfg.optim)
    # DeepSpeed prints build notes on stdout (it JIT-builds a shared-memory all-reduce that it uses
    # only for inference on CPU); stdout is kept for the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False,
                                   verbose=False)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(cfg),
                                               dist_init_required=False)
    per_rank = cfg.train.global_batch_size // WORLD
    rows = slice(rank * per_rank, (rank + 1) * per_rank)  # the block shard_global_batch gives this rank

    def step(batch: torch.Tensor) -> tuple[float, float]:
        inputs, targets = batch[rows, :-1], batch[rows, 1:]
        out = engine(inputs)
        loss = token_loss_sum(out.logits, targets) / targets.numel() + out.aux_loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().double()
        dist.all_reduce(mean)
        return (mean / WORLD).item(), float(engine.get_global_grad_norm())

    return step


def paired_rank(config_path: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Runs on every rank: both trainers side by side, one step of each in turn (who goes first
    alternates), each step timed between barriers. Returns per side: seconds, losses, grad norms."""
    cfg = load_config(config_path, overrides)
    trainers = {"tessera": tessera_trainer(cfg), "deepspeed": deepspeed_trainer(cfg)}
    out = {name: {"step_seconds": [], "losses": [], "grad_norms": []} for name in trainers}
    for i in range(warmup + steps):
        batch = global_batch(cfg, i)
        order = list(trainers) if i % 2 == 0 else list(reversed(trainers))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            loss, norm = trainers[name](batch)
            dist.barrier()
            seconds = time.perf_counter() - start
            if i >= warmup:
                out[name]["step_seconds"].append(seconds)
            out[name]["losses"].append(loss)
            out[name]["grad_norms"].append(norm)
    out["threads_per_rank"] = torch.get_num_threads()
    return out


def machine() -> dict:
    import deepspeed

    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "gpu": torch.cuda.is_available()}


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny-dense.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--steps", type=int, default=6, help="timed steps of each side")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each side first")
    p.add_argument("--loss-rtol", type=float, default=1e-4, help="allowed relative loss difference")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        print("DeepSpeed is not installed; nothing to compare against. Install it into this environment "
              "without replacing torch:  DS_BUILD_OPS=0 pip install -c constraints.txt deepspeed")
        return 0

    overrides = ["log.progress_bar=false", "log.tensorboard=false", "train.dtype=fp32", *args.overrides]
    cfg = load_config(args.config, overrides)
    started = time.perf_counter()
    load_before = list(os.getloadavg())
    run = run_ranks(paired_rank, WORLD, args.config, overrides, args.steps, args.warmup, timeout=3600)[0]

    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    t, d = run["tessera"], run["deepspeed"]
    for side in (t, d):
        side["step_seconds_median"] = statistics.median(side["step_seconds"])
        side["tokens_per_s"] = tokens_per_step / side["step_seconds_median"]
    # Steps of the two sides run back to back, so each pair saw about the same machine load.
    paired = statistics.median(ds / ts for ts, ds in zip(t["step_seconds"], d["step_seconds"]))
    first_diff = relative_difference(t["losses"][0], d["losses"][0])
    last_diff = relative_difference(t["losses"][-1], d["losses"][-1])
    result = {
        "benchmark": "zero_vs_deepspeed", "config": args.config, "overrides": args.overrides,
        "params": count_params(cfg.model), "world": WORLD, "backend": "gloo", "dtype": "fp32",
        "threads_per_rank": run["threads_per_rank"], "tokens_per_step": tokens_per_step,
        "steps": args.steps, "warmup": args.warmup,
        "tessera_tokens_per_s": t["tokens_per_s"], "deepspeed_tokens_per_s": d["tokens_per_s"],
        "ratio_tessera_over_deepspeed": t["tokens_per_s"] / d["tokens_per_s"],
        "ratio_median_of_paired_steps": paired,
        "first_step_loss": {"tessera": t["losses"][0], "deepspeed": d["losses"][0], "relative_diff": first_diff},
        "last_step_loss": {"tessera": t["losses"][-1], "deepspeed": d["losses"][-1], "relative_diff": last_diff},
        "losses_agree": first_diff <= args.loss_rtol and last_diff <= args.loss_rtol,
        "sides": {"tessera": t, "deepspeed": d}, "deepspeed_config": deepspeed_config(cfg),
        "machine": {**machine(), "load_average_before": load_before, "load_average_after": list(os.getloadavg())},
        "wall_seconds": time.perf_counter() - started,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU training throughput: Tessera's trainer vs the same model in HuggingFace transformers.

    python bench/gpu_train.py                      # on a GPU: the two models below, bf16
    python bench/gpu_train.py --tiny --steps 2     # small shapes, runs anywhere (CPU smoke test)

Without CUDA only `--tiny` runs: the full models are refused (exit status 2) rather than trained on
the CPU.

Models (vocabulary 4096, the bundled tokenizer's):
  dense-1.15B  LLaMA-style: dim 2048, 24 layers, 16 heads, 8 KV heads, FFN 5632
  moe-1.83B    Mixtral-style, 0.58B active: dim 2048, 12 layers, 16 heads, 8 KV heads,
               8 experts top-2, expert FFN 2816
Sequence length 2048, micro-batch 4, global batch 8 (two micro-batches accumulated), the bundled
corpus; bf16 on CUDA (bf16 compute over fp32 master weights), fp32 on CPU.

Tessera side: `Trainer.train_step` (accumulation, AdamW, clipping, schedule; `train.compile`,
`train.loss_chunk_tokens` and `train.cast_weights_per_step` at their defaults: on CUDA, compiled
blocks, the chunked LM-head loss and bf16 weight copies made once per step). Peer: the same shapes
built by `transformers.AutoModelForCausalLM.from_config` (random weights: speed does not depend on
them), trained by a plain loop in the same process on the same batches: autocast, loss summed over
tokens and divided by the batch's token count, AdamW (fused on CUDA), clipping. The two run one
after the other (Tessera first, then its memory is freed) so that each one's peak memory is its own.

Prints one JSON object: per model, for each side, tokens/s (median step), MFU (the FLOP count of
`tessera.models.flops.flops_per_token` for both sides, over the device's peak: `--peak-flops`, else
the GPU's table entry; null on CPU) and peak memory (GiB of CUDA memory allocated; null on CPU,
where one process's two sides cannot be told apart).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config.schema import RunConfig, load_config  # noqa: E402
from tessera.hf import config_to_hf  # noqa: E402
from tessera.models.counting import count_params  # noqa: E402
from tessera.models.flops import flops_per_token  # noqa: E402
from tessera.train.data_source import build_training_data  # noqa: E402
from tessera.train.run.throughput import peak_flops_for_device  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

SHAPE = {"model.dim": 2048, "model.n_heads": 16, "model.n_kv_heads": 8, "model.vocab_size": 4096,
         "model.max_seq_len": 2048}
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "dense-1.15B": ("configs/tiny-dense.yaml", {**SHAPE, "model.n_layers": 24, "model.ffn_dim": 5632}),
    "moe-1.83B": ("configs/tiny-moe.yaml", {**SHAPE, "model.n_layers": 12,
                                            "model.moe.num_experts": 8, "model.moe.top_k": 2,
                                            "model.moe.ffn_dim": 2816}),
}
BATCH = {"train.seq_len": 2048, "train.micro_batch_size": 4, "train.global_batch_size": 8}
TINY_SHAPE = {"model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.n_layers": 2,
              "model.ffn_dim": 128, "model.moe.ffn_dim": 32, "model.moe.num_experts": 4, "model.max_seq_len": 64}
TINY_BATCH = {"train.seq_len": 32, "train.micro_batch_size": 2, "train.global_batch_size": 4}


def run_config(name: str, tiny: bool, device: str, dtype: str, run_dir: str, extra: list[str]) -> RunConfig:
    path, shape = MODELS[name]
    if tiny:
        is_moe = ".moe." in "".join(shape)
        shape = {k: v for k, v in TINY_SHAPE.items() if is_moe or ".moe." not in k}
    sets = {**shape, **(TINY_BATCH if tiny else BATCH)}
    overrides = [f"{k}={v}" for k, v in sets.items()] + [
        f"run_dir={run_dir}", f"train.device={device}", f"train.dtype={dtype}", "train.steps=1000000",
        "train.eval_interval=0", "checkpoint.interval=0", "log.progress_bar=false", "log.tensorboard=false",
        "optim.fused=" + ("true" if device == "cuda" else "false"), *extra]
    return load_config(ROOT / path, overrides)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _timed(step, device: torch.device, steps: int, warmup: int) -> float:
    """Median seconds of `step()` after `warmup` untimed calls."""
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class TransformersLoop:
    """The peer: a transformers model of the same shapes, trained by a plain loop."""

    def __init__(self, cfg: RunConfig, device: torch.device):
        from transformers import AutoConfig, AutoModelForCausalLM

        hf = dict(config_to_hf(cfg.model))
        hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).to(device)
        self.model.train()
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=device.type == "cuda")
        self.cfg, self.device = cfg, device
        self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.dtype)

    def step(self, tokens: torch.Tensor) -> None:
        t = self.cfg.train
        tokens = tokens.to(self.device, non_blocking=True)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        for i in range(t.global_batch_size // t.micro_batch_size):
            rows = slice(i * t.micro_batch_size, (i + 1) * t.micro_batch_size)
            with torch.autocast(self.device.type, dtype=self.autocast or torch.float32,
                                enabled=self.autocast is not None):
                logits = self.model(input_ids=inputs[rows]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets[rows].flatten(),
                                                     reduction="sum") / targets.numel()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _side(seconds: float, cfg: RunConfig, peak: float | None, peak_gib: float | None) -> dict[str, Any]:
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    tps = tokens / seconds
    return {"tokens_per_s": tps, "mfu": flops_per_token(cfg.model, cfg.train.seq_len) * tps / peak if peak else None,
            "peak_mem_gib": peak_gib, "step_seconds_median": seconds}


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_config(name, args.tiny, device.type, args.dtype, f"{tmp}/run", args.overrides)
        peak = peak_flops_for_device(device, args.peak_flops)
        _reset_memory(device)
        trainer = Trainer(cfg)
        tessera = _side(_timed(trainer.train_step, device, args.steps, args.warmup), cfg, peak, _peak_gib(device))
        tessera["compile"] = trainer.compile
        tessera["fp8_layers"] = len(trainer.fp8_layers)  # linear layers run in FP8 (train.fp8)
        trainer = None
        _reset_memory(device)
        batches = build_training_data(cfg).train  # the batches the trainer drew, from the same seed
        peer = TransformersLoop(cfg, device)
        hf = _side(_timed(lambda: peer.step(batches.next_batch().tokens), device, args.steps, args.warmup),
                   cfg, peak, _peak_gib(device))
        peer = None  # frees its weights and optimizer state
        _reset_memory(device)
    return {"model": name, "params": count_params(cfg.model), "active_params": count_params(cfg.model, active=True),
            "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_len, "tessera": tessera,
            "transformers": hf}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tiny", action="store_true", help="small shapes and batches (a CPU smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s of the device (default: by name)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override KEY=VALUE")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        # The full models on the CPU would train for hours in fp32 (and take GiBs of memory) before
        # printing a figure nobody wants: only the small shapes run there.
        p.error("CUDA is not available: the 1.15B/1.83B models are benchmarked on a GPU only; "
                "pass --tiny for the small-shape CPU smoke test")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    device = torch.device(args.device)
    import transformers

    result = {
        "benchmark": "gpu_train", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "tiny": args.tiny, "steps": args.steps, "warmup": args.warmup,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "results": [bench_model(name, args, device) for name in args.models],
    }
    text = json.dumps(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

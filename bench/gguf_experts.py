"""A MoE GGUF file served with its routed experts kept as the file's blocks (`GgufExperts`, through the
CPU block kernel) against the same file dequantized to float32 at load: resident expert bytes and
greedy decode tokens/s.

    python bench/gguf_experts.py [--dim 512] [--experts 16] [--top-k 4] [--layers 4] [--tokens 32]
                                 [--batch 1,8] [--rounds 2] [--kinds Q4_K,Q4_K,Q6_K] [--others F32]

The file is written here (nothing is downloaded): a random GLM-4.5-architecture model (transformers'
Glm4Moe: a dense first layer, then MoE layers of `--experts` routed experts, top `--top-k`, and one
shared expert; model dim and expert hidden dim `--dim`) laid out as llama.cpp's converter lays it out
(tests/checkpoint/gguf_more_family_files.py), its routed experts' gate, up and down in `--kinds` (the
K types as random blocks of small scales, as the tests write them; Q4_K / Q4_K / Q6_K is llama.cpp's
Q4_K_M for experts), the layers' other matrices F32 or (`--others Q8_0`) Q8_0, the embedding, the
head and the norms F32. Each mode runs in a fresh child process, the modes
alternating over `--rounds`: the model is served by the engine (`LLM(path, gguf_keep_quantized=...)`,
fp32 activations, one torch thread), then for each batch size `--batch` prompts are continued greedily
for `--tokens` tokens, once to warm up and once timed; tokens/s is the batch's generated tokens over
that call's wall time (its short prefill included), and over the process's CPU time in that call (the
figure to read on a shared machine, where wall time follows the other processes). Prints one JSON
object: each round's figures per mode, the ratios of the best rounds kept / dense, the expert bytes,
and how many greedy texts agree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "import numpy as np", "Water boils at", "My favourite book is", "In 1969, astronauts"]


def write_file(path: Path, dim: int, experts: int, top_k: int, layers: int, kinds: list[str],
               others_q8: bool = False) -> Path:
    import torch
    import transformers as tf

    from tests.checkpoint.gguf_family_files import VOCAB
    from tests.checkpoint.gguf_more_family_files import write_gguf

    torch.manual_seed(0)
    cfg = tf.Glm4MoeConfig(vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=dim // 8, max_position_embeddings=256, rms_norm_eps=1e-6,
                           bos_token_id=None, eos_token_id=0, pad_token_id=None, num_hidden_layers=layers,
                           partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=experts,
                           num_experts_per_tok=top_k, moe_intermediate_size=dim, n_shared_experts=1,
                           first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1)
    model = tf.Glm4MoeForCausalLM(cfg).eval()
    return write_gguf(model, path, "glm4moe", q8=others_q8,
                      experts=dict(zip(("gate", "up", "down"), kinds, strict=True)))


def measure(gguf: str, kept: bool, tokens: int, batches: list[int]) -> dict:
    import torch

    from tessera.infer import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(gguf, gguf_keep_quantized=kept, max_num_seqs=max(batches), max_model_len=256, block_size=16)
    experts = [m for name, m in llm.engine.model.named_modules() if name.endswith("moe.experts")]
    out = {"experts": type(experts[0]).__name__,
           "expert_bytes": sum(t.nbytes for m in experts for t in [*m.parameters(), *m.buffers()])}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for b in batches:
        prompts = PROMPTS[:b]
        llm.generate(prompts, params)  # warm-up
        start, cpu = time.perf_counter(), time.process_time()
        done = llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        generated = sum(len(c.token_ids) for c in done)
        out[f"batch{b}_tokens_per_s"] = generated / wall
        out[f"batch{b}_tokens_per_cpu_s"] = generated / cpu
        out[f"batch{b}_token_ids"] = [c.token_ids for c in done]
    llm.engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512, help="model dim and expert hidden dim (a multiple of 256)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="layers, the first dense")
    ap.add_argument("--kinds", default="Q4_K,Q4_K,Q6_K", help="GGML types of the experts' gate, up, down")
    ap.add_argument("--others", choices=["F32", "Q8_0"], default="F32",
                    help="the type of the layers' other matrices (attention, dense and shared MLPs)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (at most 8)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the two modes alternating in each")
    ap.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=["kept", "dense"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.child:
        print(json.dumps(measure(args.gguf, args.child == "kept", args.tokens, batches)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = write_file(Path(tmp) / "moe.gguf", args.dim, args.experts, args.top_k, args.layers,
                          args.kinds.split(","), args.others == "Q8_0")
        result = {"file_bytes": path.stat().st_size, "args": vars(args), "load_before": os.getloadavg(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads 1"}
        runs: dict[str, list[dict]] = {"dense": [], "kept": []}
        for _ in range(args.rounds):
            for mode in ("dense", "kept"):
                run = subprocess.run([sys.executable, __file__, "--gguf", str(path), "--tokens", str(args.tokens),
                                      "--batch", args.batch, "--child", mode], check=True, capture_output=True,
                                     text=True)
                runs[mode].append(json.loads(run.stdout.strip().splitlines()[-1]))
        result["load_after"] = os.getloadavg()
    dense, kept = runs["dense"][0], runs["kept"][0]
    result["expert_bytes"] = {"dense": dense["expert_bytes"], "kept": kept["expert_bytes"],
                              "kept_over_dense": kept["expert_bytes"] / dense["expert_bytes"]}
    for b in batches:
        for key in (f"batch{b}_tokens_per_s", f"batch{b}_tokens_per_cpu_s"):
            per_round = {mode: [r[key] for r in rs] for mode, rs in runs.items()}
            best = {mode: max(v) for mode, v in per_round.items()}
            result[key] = {**per_round, "best_kept_over_dense": best["kept"] / best["dense"]}
        result[f"batch{b}_greedy_equal"] = sum(a == b_ for a, b_ in zip(dense[f"batch{b}_token_ids"],
                                                                        kept[f"batch{b}_token_ids"], strict=True))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

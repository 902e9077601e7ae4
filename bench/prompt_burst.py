"""Where the time of a burst of prompts goes: the engine in process, without a server, over the
32-stream phase of bench/serve_vs_vllm.py.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 .venv/bin/python bench/prompt_burst.py --model /tmp/llama110m

The requests are the first pair of `serve_vs_vllm.py --requests N N --same-mix` (the same prompt and
output lengths over the same tokens of the model's corpus), all added at once, served greedy to the
end. Every step that holds a prompt chunk runs under `torch.profiler`; the result gives those steps'
wall time, the time of the operators that took most of it (self CPU time, summed over the steps),
the wall time of the whole burst and the tokens each request produced (so two builds can be checked
to give the same). A few other requests are served first, so that the kernels are built and warm.
Run two checkouts alternately to compare them. Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve_vs_vllm import build_model, corpus_ids, mixed_requests  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a LLaMA directory (--build-model writes the 110M one)")
    p.add_argument("--build-model", action="store_true")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-range", type=int, nargs=2, default=(32, 512), metavar=("LO", "HI"))
    p.add_argument("--output-range", type=int, nargs=2, default=(16, 64), metavar=("LO", "HI"))
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--top-ops", type=int, default=8)
    args = p.parse_args(argv)
    if args.build_model and not (args.model / "config.json").exists():
        build_model(args.model)

    import torch
    from torch.profiler import profile

    from tessera.infer.config import EngineConfig
    from tessera.infer.engine.llm_engine import LLMEngine
    from tessera.infer.sampling.params import SamplingParams

    ids = corpus_ids(args.model, 200_000)
    # serve_vs_vllm's --same-mix pair 1 (seed 101, content seed 100 * 32 + 1) and, to warm up, pair 2's
    burst = mixed_requests(ids, args.requests, tuple(args.prompt_range), tuple(args.output_range), seed=101,
                           content_seed=3201)
    warm = mixed_requests(ids, 3, tuple(args.prompt_range), (4, 4), seed=102, content_seed=3202)
    engine = LLMEngine.from_dir(args.model, EngineConfig(kv_cache_gib=1, max_num_seqs=64,
                                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                                         max_model_len=args.max_model_len))
    for prompt, n in warm:
        engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()

    order = [engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for prompt, n in burst]
    tokens: dict[str, list[int]] = {}
    ops: collections.Counter[str] = collections.Counter()
    prompt_steps, prompt_wall, steps = 0, 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        sched = engine.scheduler
        prompting = bool(sched.waiting) or any(not seq.is_decoding for seq in sched.running)
        steps += 1
        if prompting:
            start = time.perf_counter()
            with profile() as prof:
                outs = engine.step()
            prompt_wall += time.perf_counter() - start
            prompt_steps += 1
            for event in prof.key_averages():
                ops[event.key] += event.self_cpu_time_total / 1e3
        else:
            outs = engine.step()
        for out in outs:
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    wall = time.perf_counter() - t0
    engine.close()
    result = {
        "model": str(args.model), "requests": args.requests, "threads": torch.get_num_threads(), "steps": steps,
        "prompt_steps": prompt_steps, "prompt_steps_ms": round(prompt_wall * 1e3, 1), "burst_s": round(wall, 3),
        "prompt_ops_ms": {k: round(v, 1) for k, v in ops.most_common(args.top_ops)},
        "tokens": [tokens.get(rid) for rid in order],
    }
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

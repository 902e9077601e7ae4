"""How far apart the serving engine's and the trainer's fp32 log-probabilities of GRPO's sampled tokens
are, and how far each is from the same model run in fp64.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_logprob_diff.py MODEL_DIR [--prompts 4]

MODEL_DIR: a HuggingFace directory (the README's: `tessera convert .../SmolLM2-135M-Instruct.Q4_1.gguf
smollm2-hf`). The engine is built as GRPO's rollouts build it (tessera/eval/rollouts.py: around the
model in memory, not owned, eager, fp32) and samples `--group` completions of each of `--prompts`
prompts of examples/data/sums.jsonl at temperature 1 with their log-probabilities; the trainer's
forward (tessera/train/modes/grpo.py's scoring: the module on the packed rows of one prompt's group,
`token_logps`) scores the same tokens; a float64 copy of the model (its norms in fp64 too) gives the
reference both are compared with. `--rowwise`: the trainer's forward again with each query attending
alone over its prefix (the decode's shape) instead of the causal SDPA over the whole row, which
isolates what attention's reduction order alone contributes. Both sides attend in float64 as GRPO's fp32
runs do (train.grpo.fp64_attention: the policy's `wide_causal_attention`, EngineConfig.fp64_attention);
`--fp32-attention`: both in fp32, as before that setting. `--time R`: besides, R alternated rounds of the
phase (the engine's sampling, then the trainer's forward and backward over the rollouts) with each
setting, their median seconds (CPU time too) and the ratios fp64 / fp32. The trainer's side runs one row
per completion; GRPO's default shared-prefix rows attend in float64 as these do (each
completion's attention output the same bits: tests/models/test_shared_prefix.py). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tessera.checkpoint.hf.load import load_pretrained  # noqa: E402
from tessera.data.tokenizer import load_tokenizer  # noqa: E402
from tessera.eval.rollouts import _generate  # noqa: E402
from tessera.infer.config import EngineConfig  # noqa: E402
from tessera.infer.engine.llm_engine import LLMEngine  # noqa: E402
from tessera.models.attention import Attention, causal_attention, wide_causal_attention  # noqa: E402
from tessera.models.model_input import ModelInput  # noqa: E402
from tessera.models.norm import RMSNorm  # noqa: E402
from tessera.train.modes.grpo import Rollouts  # noqa: E402
from tessera.train.modes.grpo_packing import pack_rollouts  # noqa: E402
from tessera.train.objectives.loss import IGNORE_INDEX, token_logps  # noqa: E402


def rowwise(q, k, v, scale, window):
    """Causal attention one query at a time over its own prefix (what a decode step computes)."""
    return torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], scale=scale,
                                                     enable_gqa=q.shape[1] != k.shape[1])
                      for i in range(q.shape[2])], 2)


def score(model, seqs, mask, group: int) -> torch.Tensor:
    """The trainer's log-probabilities [N, L - 1] of the sampled tokens, one prompt's group a forward."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, seqs.shape[0], group):
            s, m = seqs[start:start + group], mask[start:start + group]
            y = s[:, 1:].masked_fill(~m, IGNORE_INDEX)
            logits = model(ModelInput(tokens=s[:, :-1])).logits
            if logits.dtype == torch.float64:  # token_logps computes in fp32
                lp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0] * m
            else:
                lp = token_logps(logits, y)
            out[start:start + group] = lp.double()
    return out


def fp64_copy(model):
    m64 = copy.deepcopy(model).double()
    for mod in m64.modules():
        if isinstance(mod, RMSNorm) and not mod.unit_offset:  # its forward computes in fp32 otherwise
            mod.fused = lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return m64


def stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a - b)[mask]
    return {"mean": d.abs().mean().item(), "max": d.abs().max().item(), "signed_mean": d.mean().item()}


def set_attention(model, wide: bool) -> None:
    """The policy's attention core as a GRPO run sets it: float64 sums (wide) or fp32."""
    for mod in model.modules():
        if isinstance(mod, Attention):
            mod.attention_core = wide_causal_attention if wide else causal_attention


def sample(model, tok, prompts, args, wide: bool) -> Rollouts:
    """The engine's rollouts (as tessera/eval/rollouts.py builds it), `seconds` their wall time."""
    config = EngineConfig(dtype="float32", device="cpu", max_model_len=128, max_num_seqs=args.prompts * args.group,
                          enforce_eager=True, cpu_prepack=False, seed=0, fp64_attention=wide)
    start = time.perf_counter()
    engine = LLMEngine.from_model(model, config, tok, frozenset({tok.eos_id}))
    outs = _generate(engine, prompts, args.group, args.max_new_tokens, 1.0, [100 * i for i in range(args.prompts)])
    engine.close()
    return Rollouts([list(o.token_ids) for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs],
                    [0.0] * len(outs), 0, time.perf_counter() - start)


def train_pass(model, seqs, mask, group: int) -> None:
    """The GRPO step's forward and backward over the rollouts, one prompt's group a micro-batch."""
    for start in range(0, seqs.shape[0], group):
        s, m = seqs[start:start + group], mask[start:start + group]
        token_logps(model(ModelInput(tokens=s[:, :-1])).logits, s[:, 1:].masked_fill(~m, IGNORE_INDEX)).sum().backward()
    model.zero_grad(set_to_none=True)


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def timings(model, tok, prompts, seqs, mask, args) -> dict:
    """Median wall and CPU seconds of sampling and of the training pass, fp32 and fp64 attention
    alternated round by round, and their ratios."""
    got = {(w, part): [] for w in (False, True) for part in ("sample", "train")}
    for _ in range(args.time):
        for wide in (False, True):
            set_attention(model, wide)
            got[(wide, "sample")].append(timed(lambda w=wide: sample(model, tok, prompts, args, w)))
            got[(wide, "train")].append(timed(lambda: train_pass(model, seqs, mask, args.group)))
    out = {}
    for part in ("sample", "train"):
        for k, name in ((0, "wall"), (1, "cpu")):
            fp32, fp64 = (statistics.median(t[k] for t in got[(w, part)]) for w in (False, True))
            out[f"{part}_{name}_s"] = {"fp32": fp32, "fp64": fp64, "ratio": fp64 / fp32}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rowwise", action="store_true")
    p.add_argument("--fp32-attention", action="store_true")
    p.add_argument("--time", type=int, default=0, metavar="R")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_pretrained(args.model, torch.float32)
    tok = load_tokenizer(args.model)
    rows = [json.loads(line) for line in (ROOT / "examples/data/sums.jsonl").read_text().splitlines()][:args.prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                                  add_generation_prompt=True)) for r in rows]
    wide = not args.fp32_attention
    set_attention(model, wide)
    ro = sample(model, tok, prompts, args, wide)
    seqs, mask, served = pack_rollouts(prompts, ro.completions, ro.engine_logps, args.group)
    served = served.double()
    trainer, reference = score(model, seqs, mask, args.group), score(fp64_copy(model), seqs, mask, args.group)
    out = {"attention": "fp64" if wide else "fp32", "tokens": int(mask.sum()),
           "engine_vs_trainer": stats(served, trainer, mask),
           "engine_vs_fp64": stats(served, reference, mask), "trainer_vs_fp64": stats(trainer, reference, mask)}
    if args.rowwise:
        for mod in model.modules():
            if isinstance(mod, Attention):
                mod.attention_core = rowwise
        out["rowwise_attention_vs_trainer"] = stats(score(model, seqs, mask, args.group), trainer, mask)
    if args.time:
        out["timings"] = timings(model, tok, prompts, seqs, mask, args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

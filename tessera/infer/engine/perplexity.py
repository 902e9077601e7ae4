"""Perplexity through the serving path, to measure what int8 weights or an int8 KV cache cost.

The text is fed in chunks through the engine's executor (`Executor.score`: on every rank under
tensor parallelism) and paged KV cache, so every chunk after the first attends to keys/values read
back from the cache (dequantised when the cache is int8), exactly as generation would.
perplexity = exp(mean over predicted tokens of -log p(token | everything before it)). Text longer
than the context is scored in independent windows of `max_model_len` tokens. With a windowed block
pool (infer/scheduling/window_blocks.py) blocks are taken chunk by chunk, the windowed layers' a
ring of the window's blocks that later chunks write over.
"""

from __future__ import annotations

import math

import torch

from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.sequence import Sequence
from tessera.infer.engine.step_outputs import ScoringChunk
from tessera.infer.sampling.params import SamplingParams


@torch.inference_mode()
def paged_nll(engine: LLMEngine, token_ids: list[int], chunk: int = 32) -> tuple[float, int]:
    """(sum of -log p over predicted tokens, number of predicted tokens) of `token_ids`."""
    if engine.has_unfinished():
        raise RuntimeError("perplexity needs an idle engine (it borrows the KV cache)")
    total, count = 0.0, 0
    window = engine.max_model_len
    for w0 in range(0, len(token_ids) - 1, window):
        ids = token_ids[w0:w0 + window]
        if len(ids) < 2:
            break
        seq = Sequence("perplexity", ids, SamplingParams(), None)
        pool = engine.blocks.window  # the windowed layers' block pool, or None
        try:
            for start in range(0, len(ids), chunk):
                piece = ids[start:start + chunk]
                if not engine.blocks.ensure_slots(seq, len(ids) if pool is None else start + len(piece), named=False):
                    raise RuntimeError("KV cache too small for one window of max_model_len tokens")
                engine.flush_kv_transfers()  # blocks it evicted reach their tier before the scoring overwrites them
                targets = ids[start + 1:start + 1 + len(piece)]
                logp = engine.executor.score([ScoringChunk(piece, start, seq.block_table, targets,
                                                           seq.window_table or None)])[0]
                total -= float(logp.sum())
                count += len(targets)
        finally:
            engine.blocks.free_sequence(seq)
    return total, count


def perplexity(engine: LLMEngine, token_ids: list[int], chunk: int = 32) -> float:
    nll, n = paged_nll(engine, token_ids, chunk)
    return math.exp(nll / n) if n else float("nan")

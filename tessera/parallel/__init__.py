"""Layer 3: the device mesh, `parallelize` (TP/SP, EP, CP, recomputation, FSDP) and pipeline stages."""

from tessera.parallel.data_parallel_batch import (
    dp_rows,
    global_count,
    global_sum,
    sequence_chunk,
    shard_global_batch,
    sum_expert_counts,
    token_dim,
)
from tessera.parallel.dims import ParallelDims
from tessera.parallel.grad_clip import clip_grad_norm_, grad_norm
from tessera.parallel.parallelize import parallelize
from tessera.parallel.pipeline import PipelineRun, build_pipeline
from tessera.parallel.vocab_parallel_loss import vocab_parallel_loss_sum

__all__ = [
    "ParallelDims", "PipelineRun", "build_pipeline", "clip_grad_norm_", "dp_rows", "global_count",
    "global_sum", "grad_norm", "parallelize", "sequence_chunk", "shard_global_batch", "sum_expert_counts",
    "token_dim", "vocab_parallel_loss_sum",
]

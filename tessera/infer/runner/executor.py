"""Executors: the engine's model on every rank it runs on.

`Executor` is what the engine asks of one: run a step's plan (`execute_model`), score given targets
(`score`, `score_targets`), zero KV blocks on every rank (`clear_blocks`), say why it cannot run any more
(`failure`) and stop (`close`). It holds this process's model (`model`, under tensor parallelism rank
0's shard) over its KV cache (`local`), its LoRA adapters (`lora`), the cache's geometry
(`geometry`) and the model runner that samples (`runner`).

`InProcessExecutor` serves from this process alone; `tp_executor.TensorParallelExecutor` from this
process and N - 1 worker processes that it starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

from tessera.infer.config import EngineConfig
from tessera.infer.engine.step_outputs import RunnerOutput, SchedulerOutput, ScoringChunk, TargetScores
from tessera.infer.runner.lora import LoRAManager
from tessera.infer.runner.model_runner import ModelRunner
from tessera.infer.runner.multimodal import ImageEncoder
from tessera.infer.runner.paged_model import CacheGeometry, PagedModel, build_paged_model
from tessera.infer.runner.speculative import build_proposer
from tessera.infer.scheduling.kv_tier_store import KVTierStore, build_tier_store
from tessera.infer.scheduling.kv_tiers import KVTransfers
from tessera.infer.scheduling.recurrent_state import StateSlots
from tessera.infer.scheduling.state_snapshots import StateSnapshots
from tessera.models.transformer import Transformer


class Executor(Protocol):
    model: Transformer  # this process's model (rank 0's shard under tensor parallelism)
    local: PagedModel  # that model over this process's KV cache
    lora: LoRAManager  # its dynamic LoRA adapters
    geometry: CacheGeometry
    runner: ModelRunner
    kv_tiers: KVTierStore | None  # the bytes of the KV tiers below that cache (None: no tiers)

    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the plan's forward on every rank and sample: each completing request's new tokens."""

    def score(self, chunks: list[ScoringChunk]) -> list[torch.Tensor]:
        """The log-probabilities of each chunk's targets (`ModelRunner.score`), on every rank."""

    def score_targets(self, chunks: list[ScoringChunk]) -> list[TargetScores]:
        """`score` and whether each target is its row's argmax (`ModelRunner.score_targets`)."""

    def apply_kv_transfers(self, transfers: KVTransfers | None) -> None:
        """Make the copies between KV tiers a plan asks (`execute_model` does, before the forward)."""

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero KV blocks on every rank (a request failing on inf/NaN left them)."""

    @property
    def failure(self) -> Exception | None:
        """Why no step can run any more (a tensor-parallel rank failed); None while they can."""

    def close(self) -> None:
        """Stop what the executor started (worker processes); no step runs afterwards."""


@contextlib.contextmanager
def closed_on_error(close: Callable[[], None]):
    """Run the block; if it raises, `close()` what was started for it (worker processes must not
    outlive a start-up that failed), then re-raise."""
    try:
        yield
    except BaseException:
        close()
        raise


def lora_manager(model: Transformer, config: EngineConfig) -> LoRAManager:
    return LoRAManager(model, config.max_loras, config.torch_dtype, torch.device(config.device))


def state_books(local: PagedModel, config: EngineConfig,
                geometry: CacheGeometry) -> tuple[StateSlots | None, StateSnapshots | None]:
    """The driver's bookkeeping of a hybrid model's recurrent-state pool (`local.states`): which request
    owns which slot, and which block which prefix-cache snapshot (None for what it has none of). Under
    tensor parallelism rank 0 keeps them for every rank, whose pools have the same slots."""
    states = local.states
    if states is None:
        return None, None
    snapshots = (StateSnapshots(states.num_snapshots, config.block_size, geometry.snapshot_tokens)
                 if states.num_snapshots else None)
    return StateSlots(states.num_slots), snapshots


class InProcessExecutor:
    """The model in this process: `model` is in `config.dtype` on `config.device`; `encoder`: a
    vision-language model's image encoder (multimodal.py), whose feature rows the items with images
    take (`model` is then its language model). With KV tiers (`config.has_kv_tiers`) their store is
    built over this process's cache (`kv_tiers`); the engine plans over it (`KVTierPlanner.over`)."""

    def __init__(self, model: Transformer, config: EngineConfig, encoder: ImageEncoder | None = None):
        self.model = model
        self.lora = lora_manager(model, config)
        self.local, self.geometry = build_paged_model(model, config, self.lora, encoder=encoder)
        proposer = build_proposer(config, model.cfg.vocab_size, self.geometry.num_blocks, self.local)
        self.runner = ModelRunner(self.local, proposer, *state_books(self.local, config, self.geometry))
        self.kv_tiers: KVTierStore | None = None
        if config.has_kv_tiers:  # the host / disk tiers' bytes, below this process's cache
            self.kv_tiers = build_tier_store(model, self.local.kv, config.kv_offload_gib, config.kv_cache_dir,
                                             config.kv_cache_dir_gib)

    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput:
        self.apply_kv_transfers(plan.kv)
        return self.runner.execute(plan)

    def apply_kv_transfers(self, transfers: KVTransfers | None) -> None:
        if transfers:
            self.kv_tiers.apply(transfers)

    def score(self, chunks: list[ScoringChunk]) -> list[torch.Tensor]:
        return self.runner.score(chunks)

    def score_targets(self, chunks: list[ScoringChunk]) -> list[TargetScores]:
        return self.runner.score_targets(chunks)

    def clear_blocks(self, blocks: list[int]) -> None:
        self.local.clear_blocks(blocks)

    @property
    def failure(self) -> Exception | None:
        return None

    def close(self) -> None:
        pass

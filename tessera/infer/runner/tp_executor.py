"""The tensor-parallel executor: rank 0's side of serving a model cut over N ranks.

`TensorParallelExecutor.start_for_dir` / `start_for_model` start ranks 1..N-1 (`tp_workers`), cut
rank 0's own shard (`tensor_parallel`) and wait until every worker holds its shard and KV cache.
Rank 0 then drives every step: its model runner's forward is a `TensorParallelModel`, which sends
the step to the other ranks (`tp_channel`) and runs the same forward with them. A rank that fails,
or a step interrupted on rank 0, ends serving: `failure` says why, and every later step raises it.
LoRA adapters and quantized (int8, fp8, int4) weights are served on one rank only (`EngineConfig` refuses them here).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.checkpoint.gguf.reader import is_gguf_path
from tessera.checkpoint.int8 import is_quantized_dir
from tessera.checkpoint.loading import load_model
from tessera.checkpoint.prequantized.detect import is_prequantized_hf, quantization_config
from tessera.config.errors import ConfigError
from tessera.config.hf_config import is_hf_directory, read_hf_config
from tessera.infer.config import EngineConfig
from tessera.infer.engine.step_outputs import RunnerOutput, SchedulerOutput, ScoringChunk, TargetScores
from tessera.infer.runner.executor import closed_on_error, lora_manager, state_books
from tessera.infer.runner.model_runner import ModelRunner
from tessera.infer.runner.paged_model import BatchItem, PagedModel, build_paged_model, cache_geometry
from tessera.infer.runner.speculative import build_proposer
from tessera.infer.runner.tensor_parallel import cut_for_serving, serving_dims, serving_shard_from_hf
from tessera.infer.runner.tp_channel import CLEAR, KEEP, PACKED, STEP, pack_items, run_step
from tessera.infer.runner.tp_workers import WorkerFailure, WorkerGroup, WorkerSource, check_device_count, rank_device
from tessera.models.transformer import Transformer


class TensorParallelModel:
    """Rank 0's `PagedForward`: each call has the other ranks run the same forward on their shards
    and returns full-vocabulary logits in the rows that rank 0 reads."""

    def __init__(self, local: PagedModel, workers: WorkerGroup):
        self.local, self.workers = local, workers
        self.vocab_size = local.model.cfg.vocab_size

    def forward_split(self, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        return self._run(STEP, items)

    def forward(self, items: list[BatchItem]) -> torch.Tensor:
        return self._run(PACKED, items)[0]

    def _run(self, kind: int, items: list[BatchItem]) -> tuple[torch.Tensor, list[int]]:
        def step():
            self.workers.channel.send(kind, pack_items(items))
            logits, offsets = run_step(self.local, kind, items, self.vocab_size, self.workers.channel.data)
            if logits.is_cuda:
                # NCCL collectives only queue work: a rank that died or failed shows at the next
                # wait on the device. Waiting here makes that happen inside `guarded`, which
                # names the rank and marks the group failed, instead of at sampling's host copy.
                torch.cuda.synchronize(logits.device)
            return logits, offsets
        return self.workers.guarded(step)

    def clear_blocks(self, blocks: list[int]) -> None:
        if blocks:
            self.workers.guarded(lambda: self.workers.channel.send(CLEAR, list(blocks)))
        self.local.clear_blocks(blocks)

    def keep_verified(self, kept: dict[int, int]) -> None:
        """Every rank's recurrent-state slots keep the state after their verified tokens."""
        if kept:
            self.workers.guarded(lambda: self.workers.channel.send(KEEP, [n for pair in kept.items() for n in pair]))
        self.local.keep_verified(kept)


class TensorParallelExecutor:
    """Rank 0 of N: `model` is its shard, `workers` the other ranks, started and holding theirs."""

    def __init__(self, workers: WorkerGroup, model: Transformer, config: EngineConfig):
        self.workers, self.model = workers, model
        self.lora = lora_manager(model, config)  # stays empty: adapters are served on one rank
        self.local, self.geometry = build_paged_model(model, config, self.lora)
        proposer = build_proposer(config, model.cfg.vocab_size, self.geometry.num_blocks)
        self.runner = ModelRunner(TensorParallelModel(self.local, workers), proposer,
                                  *state_books(self.local, config, self.geometry))
        self.kv_tiers = None  # KV tiers are served on one rank (EngineConfig refuses them here)

    @classmethod
    def start_for_dir(cls, path: str | Path, config: EngineConfig) -> tuple[TensorParallelExecutor, dict | None]:
        """Serve the directory at `path`; (the executor, the Tessera run config or None). A
        HuggingFace directory is read a slice per rank; a Tessera checkpoint is loaded whole by
        every rank and cut."""
        path = Path(path)
        n = config.tensor_parallel_size
        _check_devices(config)
        if is_quantized_dir(path):
            raise ConfigError(f"tensor_parallel_size={n} is not supported for a pre-quantized (int8) directory; "
                              "serve it with tensor_parallel_size=1")
        if is_prequantized_hf(path):
            qc = quantization_config(path)
            raise ConfigError(f"tensor_parallel_size={n} is not supported for a pre-quantized directory "
                              f"(quant_method={qc.get('quant_method')!r}): its quantized layers are served on one "
                              "rank; serve it with tensor_parallel_size=1")
        full, run_cfg = None, None
        if config.gguf_keep_quantized and not is_gguf_path(path):
            raise ConfigError(f"gguf_keep_quantized=True with tensor_parallel_size={n} applies to GGUF files (each "
                              f"rank keeps its part of the blocks); {str(path)!r} is not one (an MXFP4 directory's "
                              "experts are kept packed on one rank): drop the option or serve it on one rank")
        if is_hf_directory(path):
            cfg = read_hf_config(path)
        else:  # a Tessera checkpoint, or nothing a model can be loaded from: the loader says which
            full, _, run_cfg = load_model(path, config.torch_dtype, rank_device(config.device, 0),
                                          bool(config.gguf_keep_quantized))
            cfg = full.cfg
        dims = serving_dims(cfg, n)  # refused before any process starts
        cache_geometry(cfg, config)
        group = WorkerGroup(n, config, WorkerSource(str(path), sliced=full is None, cfg=cfg))
        with closed_on_error(group.stop):
            dims.build_mesh(group.device.type)
            if full is None:
                model = serving_shard_from_hf(path, cfg, dims, config.torch_dtype, group.device)
            else:
                model = cut_for_serving(full, dims, config.cpu_prepack)
            group.wait_ready()
            return cls(group, model, config), run_cfg

    @classmethod
    def start_for_model(cls, model: Transformer, config: EngineConfig) -> TensorParallelExecutor:
        """Serve a model in memory: its weights go to the workers once, through shared memory, and
        this rank's copy is cut in place. `model` is consumed: it becomes rank 0's shard, whose
        hooks use the serving process group, so it cannot be used on its own afterwards (copying
        it instead would double rank 0's memory)."""
        _check_devices(config)
        dims = serving_dims(model.cfg, config.tensor_parallel_size)  # refused before any process starts
        cache_geometry(model.cfg, config)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        group = WorkerGroup(config.tensor_parallel_size, config, WorkerSource(cfg=model.cfg, state=state))
        with closed_on_error(group.stop):
            dims.build_mesh(group.device.type)
            model = cut_for_serving(model, dims)
            group.wait_ready()
            return cls(group, model, config)

    def execute_model(self, plan: SchedulerOutput) -> RunnerOutput:
        self.apply_kv_transfers(plan.kv)
        return self.runner.execute(plan)

    def apply_kv_transfers(self, transfers) -> None:
        """KV tiers are refused with tensor_parallel_size > 1 (EngineConfig), so no plan has copies."""
        if transfers:
            raise RuntimeError("KV tiers are served on one rank; this plan has copies between tiers")

    def score(self, chunks: list[ScoringChunk]) -> list[torch.Tensor]:
        return self.runner.score(chunks)

    def score_targets(self, chunks: list[ScoringChunk]) -> list[TargetScores]:
        return self.runner.score_targets(chunks)

    def clear_blocks(self, blocks: list[int]) -> None:
        self.runner.paged.clear_blocks(blocks)

    @property
    def failure(self) -> WorkerFailure | None:
        """The WorkerFailure that ended tensor-parallel serving (None while healthy)."""
        return self.workers.failure

    def close(self) -> None:
        self.workers.stop()


def _check_devices(config: EngineConfig) -> None:
    if torch.device(config.device).type == "cuda":
        check_device_count(config.device, config.tensor_parallel_size, torch.cuda.device_count())

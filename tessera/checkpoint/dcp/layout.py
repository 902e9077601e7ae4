"""A Tessera checkpoint written from a HuggingFace directory, cut into the shards of a target layout.

    tessera convert HF_DIR DST --set parallel.tp=2 --set parallel.dp_shard=4

writes `DST/step_00000000` whose DCP chunks are exactly the distinct shards the ranks of that
layout hold (tensor, expert and data parallelism, pipeline stages), so a run started from it under
that layout (`train.init_from=DST`) reads one chunk per tensor on each rank and nothing it does not
own. It still loads under any other layout or on one process: DCP reshards on load.

No rank is started. For each target rank r, a fresh process joins a fake process group as rank r of
the target world (no communication happens; a collective would return garbage), builds the model
on the meta device and cuts it with the trainer's own code (`parallelize`, pipeline stages from
`rank_stage_modules`); the box of every tensor it holds (`hf.slices.local_box`) is what DCP
records for that rank when training saves. Each rank is computed in its own process because
DTensor caches sharding results keyed by mesh layout, not by rank, within one process.

The boxes of all ranks, replicated ones counted once, become the write items of one DCP save
(`_BoxPlanner`); each item's data is read from the safetensors only when the writer asks for it
(`HFSliceReader`), so one box at a time is in memory. DCP validates that every tensor's chunks
cover it exactly, without overlap. meta.json holds the run configuration with this `parallel`
section and the files' checksums, as every Tessera checkpoint does.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.hf.slices import HFSliceReader, local_box
from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.config.parallel import ParallelConfig
from tessera.config.schema import RunConfig, config_from_dict

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)


def layout_run_config(model_cfg: ModelConfig, overrides: list[str], run_dir: str) -> RunConfig:
    """A run configuration for `model_cfg` with the `parallel.*` overrides applied (any other key
    is refused: this names a layout, not a run)."""
    from tessera.config.overrides import apply_overrides

    for o in overrides:
        key = o.partition("=")[0].strip()
        if not key.startswith("parallel."):
            raise ConfigError(f"convert --set {o!r} is invalid: only parallel.* keys (the layout the checkpoint is "
                              "cut for) may be set here, e.g. --set parallel.tp=2")
    raw = {"model": model_cfg.to_dict(), "run_dir": run_dir,
           "train": {"seq_len": min(RunConfig().train.seq_len, model_cfg.max_seq_len)}}
    return config_from_dict(apply_overrides(raw, list(overrides)))


def layout_world(cfg: ParallelConfig) -> int:
    """Ranks of the layout; an unset dp_shard (-1, fill the world) counts as 1."""
    return cfg.pp * cfg.dp_replicate * max(cfg.dp_shard, 1) * cfg.cp * cfg.tp


def rank_boxes(model_cfg: ModelConfig, pcfg: ParallelConfig, world: int, rank: int) -> dict[str, Box]:
    """The box of every state-dict tensor rank `rank` of the layout holds (call in a fresh process:
    it joins a fake process group)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tessera.models import Transformer
    from tessera.parallel import parallelize
    from tessera.parallel.dims import ParallelDims
    from tessera.parallel.pipeline import rank_stage_modules

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.from_config(pcfg, world)
        dims.validate(model_cfg, world, vpp=pcfg.stages_per_rank)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(model_cfg, init_seed=None)

        def stage(m: torch.nn.Module) -> torch.nn.Module:
            return parallelize(m, dims, pcfg, device_type="cpu")

        parts = (rank_stage_modules(model, dims, pcfg.vpp, 1.0, stage, schedule=pcfg.pp_schedule)[1]
                 if dims.pp > 1 else [stage(model)])
        return {k: local_box(t) for m in parts for k, t in m.state_dict(keep_vars=True).items()}
    finally:
        dist.destroy_process_group()


def layout_boxes(model_cfg: ModelConfig, pcfg: ParallelConfig) -> dict[str, list[Box]]:
    """Every tensor's distinct boxes over all ranks of the layout, in rank order."""
    world = layout_world(pcfg)
    # Each rank in a process of its own, forked from a fork server that imported this module and
    # nothing else: forking the caller itself copies whatever its other threads were doing (a serving
    # engine, OpenMP teams), and a child that then crashed in its garbage collector left the pool
    # waiting for its result forever.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    with ctx.Pool(min(world, os.cpu_count() or 1), maxtasksperchild=1) as pool:
        per_rank = pool.starmap(rank_boxes, [(model_cfg, pcfg, world, r) for r in range(world)])
    out: dict[str, list[Box]] = {}
    for boxes in per_rank:
        for key, box in boxes.items():
            if box not in out.setdefault(key, []):
                out[key].append(box)
    return out


class _BoxPlanner(DefaultSavePlanner):
    """Saves `model.<key>` as the given chunks, each read from the HuggingFace files when written."""

    def __init__(self, reader: HFSliceReader, boxes: dict[str, list[Box]], shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, torch.dtype]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.reader, self.boxes, self.shapes, self.dtypes = reader, boxes, shapes, dtypes

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, boxes in self.boxes.items():
            for offsets, sizes in boxes:
                items.append(WriteItem(
                    index=MetadataIndex(f"model.{key}", torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                properties=TensorProperties(dtype=self.dtypes[key]),
                                                size=torch.Size(self.shapes[key]))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        key = write_item.index.fqn.removeprefix("model.")
        chunk = write_item.tensor_data.chunk
        return self.reader.read(key, tuple(chunk.offsets), tuple(chunk.sizes), self.dtypes[key]).contiguous()


def save_layout_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, overrides: list[str],
                           dtype: torch.dtype = torch.float32, tokenizer: str | None = None) -> Path:
    """HuggingFace directory `src` -> Tessera checkpoint root `dst` (step 0, model weights only)
    whose chunks are the shards of the layout `overrides` (`parallel.K=V`) name."""
    from tessera.checkpoint.hf.load import check_hf_fits
    from tessera.config.hf_config import read_hf_config
    from tessera.models.transformer import Transformer, kept_in_fp32

    model_cfg = read_hf_config(src)
    cfg = layout_run_config(model_cfg, overrides, str(dst))
    cfg.data.tokenizer = tokenizer
    with torch.device("meta"):
        state = Transformer(model_cfg, init_seed=None).state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    dtypes = {k: torch.float32 if kept_in_fp32(k) else dtype for k in state}  # as load_pretrained keeps them
    reader = HFSliceReader(src, model_cfg)
    check_hf_fits(reader, shapes, f"HuggingFace directory {str(src)!r}")
    boxes = layout_boxes(model_cfg, cfg.parallel)
    layout = {"world_size": layout_world(cfg.parallel), "parallel": dataclasses.asdict(cfg.parallel)}
    return ckpt.save_checkpoint(dst, 0, {}, {"config": cfg.to_dict(), "layout": layout}, keep_last=1,
                                planner=_BoxPlanner(reader, boxes, shapes, dtypes))

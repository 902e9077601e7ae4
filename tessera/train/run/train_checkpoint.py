"""What a training checkpoint holds, and how it is restored under the same or another layout.

    model.<name>                  every weight and buffer by parameter name, global shape
    optim.state.<name>.<key>      AdamW's step / exp_avg / exp_avg_sq of each parameter
    optim.param_groups.<name>.<k> its group's hyper-parameters (lr, betas, weight decay, ...)
    trainer                       step, tokens seen, schedule, data position (JSON text; the same on
                                  every rank, so DCP stores it once)
    rng.rank<r>                   rank r's RNG states (Python, NumPy, torch CPU/CUDA), JSON text

Nothing in a checkpoint is unpickled beyond plain data. Checkpoints of the older format hold trainer
and RNG state as pickles: those are read with the restricted unpickler
(tessera.checkpoint.dcp.restricted_unpickle), which builds only containers, numbers, NumPy arrays and
tensors and refuses anything else with a CheckpointError.

Model and optimizer come from `get_state_dict(..., flatten_optimizer_state_dict=True)`: tensors
are DTensors where FSDP / TP / EP split them, and every key is a parameter name, whichever
pipeline stage holds it. DCP (`torch.distributed.checkpoint`) writes each shard once and reads
any other split back, so a run saved under one layout (one process, dp_shard=4, tp=2 x pp=2,
...) resumes under another.

What is restored on resume:
- weights, optimizer moments, step, tokens seen, schedule position and data position: always.
  The data position counts samples of global batches, which every rank reads whole, so the
  next batch is the same under any layout.
- `parallel.optimizer=distributed`: `optim.rank<r>.bucket<b>.master` and
  `optim.rank<r>.piece<i>.{step,exp_avg,exp_avg_sq}` are rank r's fp32 master shards and AdamW
  state (DistributedOptimizer.sharded_state_dict); `model.*` holds the replicated weights in the
  compute dtype. Such a checkpoint resumes under the layout that wrote it only (refused otherwise).
- RNG states: rank r restores `rng.rank<r>` when the checkpoint was written by the same world size
  and parallel layout; otherwise every rank restores rank 0's states (in a fresh run, too, all
  ranks start from one seeded state). Draws that depend on a rank's position (router jitter,
  dropout) then differ from an uninterrupted run, as they would between layouts anyway.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.restricted_unpickle import restricted_loads
from tessera.config.errors import CheckpointError
from tessera.config.json_text import parse_json
from tessera.config.schema import RunConfig
from tessera.parallel.distributed_optimizer import DistributedOptimizer
from tessera.train.optimizer import has_parameters
from tessera.train.run.rng_state import capture_rng_state, decode_rng_state, encode_rng_state, restore_rng_state
from tessera.train.vision_language import is_vision_run, vision_language_entry

STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def layout_signature(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """What decides which rank holds what: the world size and the parallel section, as meta.json
    gives it back (tuple fields such as parallel.recompute_save read back as lists)."""
    return json.loads(json.dumps({"world_size": world_size, "parallel": dataclasses.asdict(cfg.parallel)}))


def model_and_optimizer_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]
                              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state of all this rank's modules, keyed by parameter name."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for module, optimizer in zip(parts, optimizers, strict=True):
        if isinstance(optimizer, DistributedOptimizer):
            model_sd.update(get_model_state_dict(module, options=STATE_OPTIONS))
            optim_sd.update(optimizer.sharded_state_dict())
            continue
        m, o = part_state(module, optimizer)
        model_sd.update(m)
        optim_sd.update(o)
    return model_sd, optim_sd


def part_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """One part's model and optimizer state; a part with nothing to train (a pipeline stage of a
    frozen language model) has its weights only (torch refuses an empty optimizer state here)."""
    if not has_parameters(optimizer):
        return get_model_state_dict(module, options=STATE_OPTIONS), {}
    return get_state_dict(module, optimizer, options=STATE_OPTIONS)


def training_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], trainer_state: dict[str, Any],
                   cfg: RunConfig, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the DCP state dict, meta.json's fields) of this rank's part of a checkpoint, now. Its tensors are
    the live ones: a background save copies them first (tessera.checkpoint.dcp.background)."""
    model_sd, optim_sd = model_and_optimizer_state(parts, optimizers)
    state = {"model": model_sd, "optim": optim_sd, "trainer": json.dumps(trainer_state),
             "rng": {f"rank{rank}": json.dumps(encode_rng_state(capture_rng_state()))}}
    meta = {"config": cfg.to_dict(), "layout": layout_signature(cfg, world_size)}
    if is_vision_run(cfg):  # the LLaVA / Qwen-VL config and image processor, for tessera convert / export_hf
        meta["vision_language"] = vision_language_entry(cfg)
    return state, meta


def save_training_state(root: Path, step: int, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                        trainer_state: dict[str, Any], cfg: RunConfig, rank: int, world_size: int) -> Path:
    """Write checkpoint `step` under `root` (every rank calls this; rank 0 completes the directory)."""
    state, meta = training_state(parts, optimizers, trainer_state, cfg, rank, world_size)
    return ckpt.save_checkpoint(root, step, state, meta, cfg.checkpoint.keep_last)


def load_training_state(path: Path, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                        expected_shapes: dict[str, tuple[int, ...]], cfg: RunConfig, rank: int,
                        world_size: int) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from checkpoint `path`; returns the trainer state.

    `expected_shapes` are the whole model's (every stage's) tensors, checked before anything loads.
    """
    ckpt.check_compatible(path, "model", expected_shapes)
    stored = ckpt.checkpoint_tensor_shapes(path)
    meta = ckpt.read_meta(path)
    same_layout = meta.get("layout") == layout_signature(cfg, world_size)
    rng_key = f"rank{rank}" if same_layout else "rank0"
    sharded = any(isinstance(o, DistributedOptimizer) for o in optimizers)
    if sharded and not same_layout:
        raise CheckpointError(f"checkpoint {str(path)!r} holds the state of parallel.optimizer=distributed, which "
                              "resumes only under the layout that wrote it (world size and parallel.* unchanged): "
                              f"it was written by {meta.get('layout')}")
    if sharded:
        per_part = [model_and_optimizer_state([m], [o]) for m, o in zip(parts, optimizers, strict=True)]
    else:
        per_part = [part_state(m, o) for m, o in zip(parts, optimizers, strict=True)]
    state: dict[str, Any] = {"model": {k: v for m, _ in per_part for k, v in m.items()},
                             "optim": {k: v for _, o in per_part for k, v in o.items()}, "trainer": ""}
    if f"rng.{rng_key}" in stored:
        state["rng"] = {rng_key: ""}
    ckpt.load_checkpoint(path, state)  # tensors are loaded in place, resharded to this layout
    for module, optimizer, (mine_m, mine_o) in zip(parts, optimizers, per_part, strict=True):
        if sharded or not has_parameters(optimizer):  # the optimizer's shards were loaded in place, or it has none
            set_model_state_dict(module, {k: state["model"][k] for k in mine_m}, options=STATE_OPTIONS)
            continue
        set_state_dict(module, optimizer, model_state_dict={k: state["model"][k] for k in mine_m},
                       optim_state_dict={k: state["optim"][k] for k in mine_o}, options=STATE_OPTIONS)
    if "rng" in state:
        rng = _plain_state(state["rng"][rng_key], path, f"rng.{rng_key}")
        try:
            restore_rng_state(decode_rng_state(rng) if isinstance(state["rng"][rng_key], str) else rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {str(path)!r}: rng.{rng_key} is not an RNG state ({e})") from e
    trainer = _plain_state(state["trainer"], path, "trainer")
    if not isinstance(trainer, dict) or not {"step", "tokens_seen", "scheduler", "data"} <= set(trainer):
        raise CheckpointError(f"checkpoint {str(path)!r}: its trainer state lacks step / tokens_seen / scheduler "
                              "/ data; the checkpoint is damaged")
    return trainer


def _plain_state(value: Any, path: Path, key: str) -> Any:
    """JSON text as written today; bytes are a pickle of an older checkpoint, read with the
    restricted unpickler (plain data, arrays and tensors only)."""
    if isinstance(value, str):
        return parse_json(value, f"checkpoint {str(path)!r}: {key}", CheckpointError)
    if isinstance(value, bytes):
        return restricted_loads(value, "legacy-state", f"checkpoint {str(path)!r}: {key}")
    raise CheckpointError(f"checkpoint {str(path)!r}: {key} holds a {type(value).__name__}, not JSON text")

"""Held-out loss and perplexity of a model, computed the way the trainer computes its validation loss.

    cfg = loss_config("runs/tiny-dense")                     # the run's own configuration and data
    loss_on(cfg, batches=None)                               # {"loss": ..., "perplexity": ..., "tokens": ...}

The model is built by the trainer's own builder (`tessera.train.builder`) from a run configuration
with `train.init_from` set to the model, and the loss is the step engine's `evaluate`: the sum of
the token losses over the number of loss tokens (SFT masks respected), micro-batch by micro-batch,
in `train.dtype`. So for a run's checkpoint and the run's validation batches (`train.eval_steps`
global batches of its held-out split, the default) the number equals the `val_loss` the trainer
logged at that step (bit for bit on the layout it trained with), and under `--nproc N` the same
evaluation runs on any parallel layout.

MODEL may be:
- a run directory or Tessera checkpoint: its stored configuration (model, data, batch, dtype); its
  parallel layout is kept under ranks and dropped in one process (any checkpoint loads there);
- a HuggingFace directory: `model.from_hf` and `train.init_from` it, its own tokenizer. It has no
  data of its own: give `--data`.

`--data` is a Tessera dataset (the PREFIX of PREFIX.bin / PREFIX.idx, with its SFT loss mask if it
has one) or text / JSONL files (or directories of them), tokenized here with the model's tokenizer
as `tessera preprocess` would; all of its samples of seq_len + 1 tokens are evaluated, or the first
`--limit` global batches. With `--data` the batch geometry is the same for every model, whatever
its origin: samples of train.seq_len = 256 tokens (fewer when the model's context is shorter) in
global batches of 16, micro-batches of 4, so that a checkpoint, its export and its converted copies
are compared on the same samples summed in the same order; `--set train.seq_len=...` etc. change it.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.model import stored_run_config
from tessera.checkpoint.int8 import is_quantized_dir
from tessera.checkpoint.loading import trained_tokenizer
from tessera.config.errors import CheckpointError, ConfigError, DataError
from tessera.config.hf_config import is_hf_directory
from tessera.config.overrides import apply_overrides
from tessera.config.schema import RunConfig, TrainConfig, build_model_config, config_from_dict
from tessera.data.batching import Batch, eval_batches
from tessera.data.sampling import PackedDataset
from tessera.data.tokenizer import load_tokenizer

DEFAULT_SEQ_LEN = TrainConfig.seq_len  # 256, capped at the model's context


def loss_config(model: str, overrides: list[str] = (), keep_layout: bool = False,
                common_geometry: bool = False) -> RunConfig:
    """The run configuration that evaluates `model`'s loss (see the module docstring);
    `common_geometry`: the default batch geometry whatever the model's origin (for `--data`)."""
    path = Path(model)
    if not path.exists():
        raise CheckpointError(f"model {model!r} does not exist")
    if is_quantized_dir(path):
        raise ConfigError(f"{model} is a pre-quantized int8 directory; the loss task evaluates full-precision "
                          "weights: evaluate the directory it was quantized from")
    if is_hf_directory(path):
        raw: dict = {"model": {"from_hf": str(path)}, "run_dir": str(path)}
        if trained_tokenizer(path) is not None:
            raw["data"] = {"tokenizer": str(path)}
        raw["train"] = {"init_from": str(path),
                        "seq_len": min(DEFAULT_SEQ_LEN, build_model_config({"from_hf": str(path)}).max_seq_len)}
    else:
        found = ckpt.resolve_checkpoint(path)
        raw = copy.deepcopy(stored_run_config(found))
        raw.setdefault("train", {})["init_from"] = str(found)
        raw.setdefault("data", {})
        source = trained_tokenizer(path)
        raw["data"]["tokenizer"] = None if source == "default" else source
    if not keep_layout:
        raw["parallel"] = {}
    if common_geometry:
        raw["train"].update(seq_len=min(DEFAULT_SEQ_LEN, build_model_config(raw["model"]).max_seq_len),
                            global_batch_size=TrainConfig.global_batch_size,
                            micro_batch_size=TrainConfig.micro_batch_size)
    raw["train"]["compile"] = False
    return config_from_dict(apply_overrides(raw, list(overrides)))


def dataset_batches(data: str, cfg: RunConfig, max_batches: int | None, workdir: Path) -> Iterator[Batch]:
    """Every sample of `data` (a dataset prefix, or text/JSONL tokenized into `workdir`) in global
    batches of the configuration, the first `max_batches` of them when given."""
    prefix = Path(data)
    if not Path(f"{prefix}.idx").is_file():
        if not prefix.exists():
            raise DataError(f"--data {data!r} is neither a dataset (PREFIX.bin / PREFIX.idx) nor a text / JSONL file "
                            "or directory")
        from tessera.data.preprocess import preprocess

        prefix = workdir / "data"
        preprocess([data], prefix, load_tokenizer(cfg.data.tokenizer), show_progress=False)
    dataset = PackedDataset(prefix, cfg.train.seq_len, split="train", valid_fraction=0.0)
    dataset.tokens.check_token_ids(cfg.model.vocab_size)
    return eval_batches(dataset, cfg.train.global_batch_size, max_batches)


def validation_batches(cfg: RunConfig, max_batches: int | None) -> Iterator[Batch]:
    """The run's held-out batches: the first `max_batches` (default train.eval_steps), the ones its
    trainer evaluates."""
    from tessera.train.data_source import build_training_data

    if cfg.data.valid_fraction <= 0:
        raise ConfigError("this run has no validation split (data.valid_fraction=0); pass --data")
    data = build_training_data(cfg)
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {data.vocab_size} tokens, more than the model's vocabulary of "
                          f"{cfg.model.vocab_size}")
    return data.validation_batches(max_batches or cfg.train.eval_steps)


def loss_on(cfg: RunConfig, batches: Iterable[Batch]) -> dict[str, float]:
    """{"loss", "perplexity", "tokens"} of the model `cfg.train.init_from` over `batches`, by the
    trainer's builder and step engine under this process's layout (one process, or its rank)."""
    from tessera.train.builder import build_step_engine, build_training_parts
    from tessera.train.run.layout import build_layout
    from tessera.train.run.rng_state import seed_everything

    layout = build_layout(cfg)
    seed_everything(cfg.train.seed)
    built = build_training_parts(cfg, layout, cfg.train.init_from, False)
    engine = build_step_engine(cfg, layout, built)
    for part in built.parts:
        part.eval()
    with layout.phase("evaluation"):
        total, n = engine.evaluate(batches)
    if n == 0:
        raise DataError("the data holds no loss tokens (every target masked)")
    loss = total / n
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": float(n)}


def evaluate_loss(model: str, data: str | None = None, limit: int | None = None, overrides: list[str] = (),
                  keep_layout: bool = False) -> dict[str, float]:
    """`loss_on` for `model` over `data` (None: the run's validation batches)."""
    cfg = loss_config(model, overrides, keep_layout, common_geometry=data is not None)
    with tempfile.TemporaryDirectory(prefix="tessera-eval-") as tmp:
        if data is not None:
            batches = dataset_batches(data, cfg, limit, Path(tmp))
        elif is_hf_directory(model):
            raise ConfigError(f"{model} is a HuggingFace directory with no data of its own: pass --data (a dataset "
                              "prefix or text / JSONL files)")
        else:
            batches = validation_batches(cfg, limit)
        return loss_on(cfg, batches)

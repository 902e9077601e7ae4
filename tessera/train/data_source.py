"""The trainer's view of the data section: a resumable iterator of global batches and a
validation split, built from `tessera.data`.

With `data.datasets` empty the bundled corpus is used: the Python standard library's source,
tokenized with the bundled tokenizer, prepared once under `data.cache_dir` (default
$TESSERA_CACHE, else ~/.cache/tessera) and reused by every later run. Several datasets are
blended by weight. Every dataset is packed into samples of `seq_len + 1` tokens and split by
`data.valid_fraction` into training and validation samples. Its token ids are checked against
`model.vocab_size` when it is opened, so a corrupt file fails before step 1, not hours in.
`data.kind=vision_sft` reads JSONL image-text conversations (one per sample) and `data.kind=preference`
JSONL preference pairs (one pair per sample, nothing held out: tessera.data.preference) and
`data.kind=prompts` JSONL prompts for GRPO (one prompt per sample, nothing held out: tessera.data.prompts).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tessera.config.errors import DataError
from tessera.config.schema import RunConfig
from tessera.data.batching import Batch, BatchIterator, eval_batches
from tessera.data.blending import BlendedDataset
from tessera.data.corpus import prepare_corpus_dataset
from tessera.data.sampling import PackedDataset, SampleDataset
from tessera.data.tokenizer import Tokenizer, load_tokenizer

CACHE_ENV = "TESSERA_CACHE"

__all__ = ["Batch", "TrainingData", "build_training_data", "default_cache_dir"]


def default_cache_dir() -> Path:
    """$TESSERA_CACHE, else ~/.cache/tessera: where the bundled corpus is prepared."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tessera")


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train: BatchIterator  # whole global batches; its state_dict is the data position in checkpoints
    valid: SampleDataset | None  # None when data.valid_fraction is 0
    global_batch_size: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def validation_batches(self, max_batches: int) -> Iterator[Batch]:
        """The first `max_batches` validation batches, always the same ones (no randomness)."""
        if self.valid is None:
            return iter(())
        return eval_batches(self.valid, self.global_batch_size, max_batches)


def _scans_token_ids() -> bool:
    """Whether this process scans the datasets' token ids: one process, or global rank 0 of several.

    The trainer builds the data on rank 0 first and stops every rank if that fails, so one scan
    suffices; every rank scanning would read a dataset larger than memory once per rank."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _blend(parts: list[SampleDataset], weights: list[float], seed: int) -> SampleDataset:
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, seed=seed)


def build_training_data(cfg: RunConfig) -> TrainingData:
    """Tokenizer, training batches and validation samples for `cfg` (preparing the corpus if needed)."""
    d, t = cfg.data, cfg.train
    tokenizer = load_tokenizer(d.tokenizer)
    if d.kind == "vision_sft":
        return _vision_data(cfg, tokenizer)
    if d.kind == "preference":
        return _preference_data(cfg, tokenizer)
    if d.kind == "prompts":
        return _prompt_data(cfg, tokenizer)
    if d.datasets:
        prefixes = [entry.path for entry in d.datasets]
        weights = [entry.weight for entry in d.datasets]
    else:
        prefixes = [prepare_corpus_dataset(d.cache_dir or default_cache_dir(), tokenizer, show_progress=True)]
        weights = [1.0]
    train_parts = [PackedDataset(p, t.seq_len, split="train", valid_fraction=d.valid_fraction)
                   for p in prefixes]
    if _scans_token_ids():
        for part in train_parts:  # every id of the file (both splits), before the first step
            part.tokens.check_token_ids(cfg.model.vocab_size)
    if d.kind == "sft":
        for p, part in zip(prefixes, train_parts):
            if part.loss_mask is None:
                raise DataError(f"data.kind=sft but dataset {str(p)!r} has no loss mask ({p}.mask.idx); "
                                "prepare it with the SFT preprocessing")
    valid = None
    if d.valid_fraction > 0:
        valid_parts = [PackedDataset(p, t.seq_len, split="valid", valid_fraction=d.valid_fraction)
                       for p in prefixes]
        valid = _blend(valid_parts, weights, t.seed)
    train = BatchIterator(_blend(train_parts, weights, t.seed), t.global_batch_size, seed=t.seed)
    return TrainingData(tokenizer=tokenizer, train=train, valid=valid, global_batch_size=t.global_batch_size)


def _vision_data(cfg: RunConfig, tokenizer: Tokenizer) -> TrainingData:
    """data.kind=vision_sft: the JSONL conversations of data.datasets, each a sample with its images
    (tessera.data.vision_sft, as the model's family writes them: its `samples` in
    tessera.checkpoint.vision_families), the last data.valid_fraction of them held out."""
    from tessera.checkpoint.vision_families import REGISTRY
    from tessera.data.vision_sft import VisionSFTDataset, split_samples
    from tessera.train.vision_language import vision_model_config

    t = cfg.train
    model_cfg, processor = vision_model_config(cfg)
    files = [e.path for e in cfg.data.datasets]
    samples = REGISTRY[model_cfg.family].samples(files, tokenizer, processor, model_cfg, t.seq_len)
    for s in samples:
        if int(s.tokens.max()) >= cfg.model.vocab_size:
            raise DataError(f"a conversation has token id {int(s.tokens.max())}, outside model.vocab_size="
                            f"{cfg.model.vocab_size}: the tokenizer does not fit the model")
    train, valid = split_samples(samples, cfg.data.valid_fraction)
    return TrainingData(tokenizer=tokenizer, train=BatchIterator(VisionSFTDataset(train, t.seq_len),
                                                                 t.global_batch_size, seed=t.seed),
                        valid=VisionSFTDataset(valid, t.seq_len) if valid else None,
                        global_batch_size=t.global_batch_size)


def _preference_data(cfg: RunConfig, tokenizer: Tokenizer) -> TrainingData:
    """data.kind=preference: the pairs of each JSONL file of data.datasets (tessera.data.preference),
    blended by weight; one pair is one sample. Nothing is held out: DPO runs measure themselves by
    their rewards (train.eval_interval is 0)."""
    from tessera.data.preference import load_preference_files

    d, t = cfg.data, cfg.train
    parts = load_preference_files([e.path for e in d.datasets], tokenizer, t.seq_len, cfg.model.vocab_size)
    train = BatchIterator(_blend(parts, [e.weight for e in d.datasets], t.seed), t.global_batch_size, seed=t.seed)
    return TrainingData(tokenizer=tokenizer, train=train, valid=None, global_batch_size=t.global_batch_size)


def _prompt_data(cfg: RunConfig, tokenizer: Tokenizer) -> TrainingData:
    """data.kind=prompts: the prompts of each JSONL file of data.datasets (tessera.data.prompts),
    blended by weight; one prompt is one sample. Nothing is held out: GRPO runs measure themselves by
    their rewards (train.eval_interval is 0)."""
    from tessera.data.prompts import load_prompt_files

    d, t = cfg.data, cfg.train
    parts = load_prompt_files([e.path for e in d.datasets], tokenizer, t.seq_len, t.grpo.max_new_tokens,
                              cfg.model.vocab_size, min(t.seq_len + 1, cfg.model.max_seq_len))
    train = BatchIterator(_blend(parts, [e.weight for e in d.datasets], t.seed), t.global_batch_size, seed=t.seed)
    return TrainingData(tokenizer=tokenizer, train=train, valid=None, global_batch_size=t.global_batch_size)

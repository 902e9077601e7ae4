"""`train.distill.teacher`: the frozen model a student is distilled from.

    distiller = build_distiller(cfg, layout)   # None without train.distill.teacher

The teacher is a HuggingFace model directory or a Tessera checkpoint / run directory of any family
Tessera supports; its shape is its own (config.json, or the run configuration in the
checkpoint's meta.json), not the student's. Before anything is allocated it is checked against
the student: the same vocabulary size, and, where the teacher names its tokenizer (a
tokenizer.json in its directory, or a Tessera run's `data.tokenizer`), the same token -> id map
as the student's `data.tokenizer`; a mismatch is a ConfigError naming the key. A HuggingFace
directory without a tokenizer is checked on the vocabulary size alone.

It is then built by the student's builder (tessera.train.builder.build_frozen_model): cut by the
same layout, each rank reading only its shards, frozen (eval mode, no gradients, no optimizer, not
checkpointed: a resumed run reads it again from `train.distill.teacher`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from torch import nn

from tessera.checkpoint.dcp import store as ckpt
from tessera.checkpoint.dcp.model import stored_model_config
from tessera.checkpoint.loading import trained_tokenizer
from tessera.config.errors import ConfigError, TesseraError
from tessera.config.hf_config import is_hf_directory, read_language_model_config
from tessera.config.model import ModelConfig
from tessera.config.schema import RunConfig
from tessera.data.tokenizer import load_tokenizer
from tessera.train.builder import build_frozen_model
from tessera.train.objectives.distill_loss import Distiller
from tessera.train.objectives.hidden_match import HiddenMatch
from tessera.train.run.layout import RunLayout

KEY = "train.distill.teacher"


def teacher_model_config(path: str, key: str = KEY) -> ModelConfig:
    """The teacher's own model shape: its config.json, or its Tessera checkpoint's run configuration
    (`key`: the config key that named it, for the errors; an EAGLE run's target is read the same way)."""
    if not Path(path).exists():
        raise ConfigError(f"{key}={path!r} is invalid: no such directory (a HuggingFace model directory or a "
                          "Tessera checkpoint / run directory is expected)")
    try:
        if is_hf_directory(path):
            return read_language_model_config(path)
        return stored_model_config(ckpt.resolve_checkpoint(path))
    except TesseraError as e:
        raise ConfigError(f"{key}={path!r} is invalid: {e}") from e


def check_teacher(cfg: RunConfig, teacher: ModelConfig, path: str | None = None, key: str = KEY) -> None:
    """The teacher predicts over the student's vocabulary with the student's tokenizer, or is refused.
    An EAGLE run checks its target (`path`, named by `key`) the same way, its own shape as `cfg.model`."""
    path = cfg.train.distill.teacher if path is None else path
    student_vocab = cfg.model.vocab_size
    if teacher.vocab_size != student_vocab:
        raise ConfigError(f"{key}={path!r} is invalid: its vocabulary has {teacher.vocab_size} tokens, the "
                          f"student's (model.vocab_size) {student_vocab}; a teacher must use the student's "
                          "tokenizer and vocabulary")
    try:
        source = trained_tokenizer(path)
        if source is None:  # a HuggingFace directory without tokenizer files: the size is all there is
            return
        theirs = load_tokenizer(source)
        mine = load_tokenizer(cfg.data.tokenizer)
    except (TesseraError, OSError) as e:  # OSError: a tokenizer path that vanished or cannot be read
        raise ConfigError(f"{key}={path!r}: its tokenizer cannot be compared with data.tokenizer: {e}") from e
    their_vocab = theirs.backend.get_vocab(with_added_tokens=True)
    my_vocab = mine.backend.get_vocab(with_added_tokens=True)
    if their_vocab != my_vocab:
        differing = sorted(set(their_vocab.items()) ^ set(my_vocab.items()))
        raise ConfigError(f"{key}={path!r} is invalid: its tokenizer ({source}) is not the student's "
                          f"(data.tokenizer={cfg.data.tokenizer or 'default'}): {len(differing)} token -> id "
                          f"entries differ, e.g. {differing[0]!r}; a teacher must use the student's tokenizer")


def build_distiller(cfg: RunConfig, layout: RunLayout, student: nn.Module) -> Distiller | None:
    """The teacher, checked, built and frozen under `layout`, with train.distill's loss (and, with
    `hidden_layers`, the projections matching `student`'s hidden states to it); None without one."""
    d = cfg.train.distill
    if d.teacher is None:
        return None
    teacher_cfg = teacher_model_config(d.teacher)
    check_teacher(cfg, teacher_cfg)
    bad = [list(pair) for pair in d.hidden_layers if pair[1] >= teacher_cfg.n_layers]
    if bad:
        raise ConfigError(f"train.distill.hidden_layers={[list(p) for p in d.hidden_layers]} is invalid: {bad} name "
                          f"teacher layers the teacher ({d.teacher}) does not have: it has {teacher_cfg.n_layers} "
                          f"(0..{teacher_cfg.n_layers - 1})")
    with layout.phase("loading the distillation teacher"):
        teacher = build_frozen_model(replace(cfg, model=teacher_cfg), layout, d.teacher)
    hidden = None
    if d.hidden_layers:
        hidden = HiddenMatch(d.hidden_layers, student, teacher, cfg.model.dim, teacher_cfg.dim, cfg.train.seed,
                             layout.device, cfg.optim)
    return Distiller(teacher, d.temperature, d.weight, hidden, d.hidden_weight)

"""`prune(src, dst, ...)`: a HuggingFace directory in, a smaller HuggingFace directory out.

    result = prune("llama-1b/", "llama-700m/", PruneSizes(layers=12), target_params=None)

Load the source (any family Tessera reads; a weight that holds a NaN or an infinity is refused by
name before any work), measure importance on calibration sequences
(importance.py), choose the sizes (given, or searched for `target_params`: target.py) and the parts
to keep (selection.py), and write the kept weights as a HuggingFace directory of the same family,
dtype and tokenizer: its config.json is the source's with the changed fields replaced (the sizes,
the renumbered dense layers, and `head_dim` always, so that fewer heads, or a smaller hidden size,
keep the heads' width), and its
generation_config.json is the source's.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.checkpoint.calibration import check_finite_weights, load_calibration, stored_dtype
from tessera.checkpoint.convert import check_new_destination
from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.writer import save_pretrained
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.hf_config import config_to_hf, is_hf_directory, read_hf_config, read_json_object
from tessera.data.atomic_write import atomic_output
from tessera.models.counting import count_params
from tessera.models.transformer import Transformer
from tessera.prune.hidden import check_hidden_axes
from tessera.prune.importance import Importance, measure_importance
from tessera.prune.selection import (
    PruneSizes,
    Selection,
    check_sizes,
    pruned_config,
    pruned_state,
    select,
)
from tessera.prune.target import search_sizes

DEFAULT_SEQUENCES = 16  # calibration sequences: Minitron finds a few hundred to a thousand samples enough;
DEFAULT_SEQ_LEN = 256  # ... a CPU run keeps it small (--calibration-sequences raises it)
# config.json lists with one entry per layer (transformers 5 writes `layer_types`): the kept layers' entries
PER_LAYER_KEYS = ("layer_types",)
# config.json names of one field that transformers releases spell differently (Tessera reads either, so
# a source may hold the one Tessera does not write): a changed field changes its other names too
ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",)}


@dataclass(frozen=True)
class PruneResult:
    source_params: int
    params: int
    source_sizes: PruneSizes
    sizes: PruneSizes  # resolved
    selection: Selection  # the source indices kept
    importance: Importance  # what they were chosen by
    path: Path

    def summary(self) -> str:
        """One line per size: source -> pruned, and the parameter counts."""
        source = self.source_sizes
        rows = [f"layers {source.layers} -> {self.sizes.layers} (kept {self.selection.layers})",
                f"hidden size {source.dim} -> {self.sizes.dim}",
                f"ffn hidden size {source.ffn_dim} -> {self.sizes.ffn_dim}",
                f"heads {source.n_heads} -> {self.sizes.n_heads}, KV groups {source.n_kv_heads} -> "
                f"{self.sizes.n_kv_heads}"]
        if source.num_experts is not None:
            rows.append(f"experts {source.num_experts} -> {self.sizes.num_experts}")
        rows.append(f"parameters {self.source_params:,} -> {self.params:,}")
        return "\n".join(rows)


def prune(src: str | os.PathLike, dst: str | os.PathLike, sizes: PruneSizes, target_params: int | None = None,
          calibration: Sequence[str | os.PathLike] | None = None, num_sequences: int | None = None,
          seq_len: int | None = None) -> PruneResult:
    """Write `dst`, the HuggingFace model `src` pruned to `sizes` (None fields: the source's, or the
    search's for `target_params`), ranked on `calibration` (text / JSONL files; None: the bundled corpus)
    in `num_sequences` sequences of `seq_len` tokens (None: DEFAULT_SEQUENCES, DEFAULT_SEQ_LEN)."""
    if not is_hf_directory(src):
        raise CheckpointError(f"prune: {str(src)!r} is not a HuggingFace model directory (no config.json); "
                              "convert a Tessera checkpoint first (tessera convert)")
    check_new_destination("prune", src, dst)
    cfg = read_hf_config(src)
    source_params = count_params(cfg)
    if target_params is not None and target_params > source_params:
        raise ConfigError(f"prune --target-params {target_params:,} is invalid: the source has {source_params:,} "
                          "parameters; give a smaller target")
    check_sizes(cfg, sizes.resolved(cfg))
    check_finite_weights("prune", src, cfg)
    tokens, tokenizer_dir = load_calibration("prune", src, cfg, calibration, num_sequences or DEFAULT_SEQUENCES,
                                             seq_len or DEFAULT_SEQ_LEN)
    model = load_pretrained(src, dtype=torch.float32)
    if sizes.dim is not None and sizes.dim != cfg.dim:  # every tensor's hidden axis must be known
        check_hidden_axes({k: tuple(v.shape) for k, v in model.state_dict().items()}, cfg.dim)
    found = measure_importance(model, tokens)
    chosen_sizes = sizes.resolved(cfg) if target_params is None else search_sizes(cfg, target_params, sizes, found)
    check_sizes(cfg, chosen_sizes)
    chosen = select(cfg, chosen_sizes, found)
    new_cfg = pruned_config(cfg, chosen_sizes, chosen.layers)
    state = pruned_state(model.state_dict(), cfg, chosen)
    del model
    pruned = Transformer(new_cfg, init_seed=None)
    pruned.load_state_dict(state, strict=True)
    _write(pruned, Path(src), Path(dst), tokenizer_dir, config_to_hf(cfg), chosen.layers)
    return PruneResult(source_params, count_params(new_cfg), PruneSizes().resolved(cfg), chosen_sizes, chosen,
                       found, Path(dst))


def _write(pruned: Transformer, src: Path, dst: Path, tokenizer_dir: str | None, before: dict,
           kept_layers: list[int]) -> None:
    """Write `dst` in the source's dtype with its tokenizer; config.json is the source's with the
    fields whose value the pruning changed, head_dim, and the per-layer lists' entries of the kept
    layers; nothing is left there if a step fails."""
    source_hf = read_json_object(src / "config.json")
    for key in PER_LAYER_KEYS:
        if isinstance(source_hf.get(key), list) and len(source_hf[key]) == before["num_hidden_layers"]:
            source_hf[key] = [source_hf[key][i] for i in kept_layers]
    created = not dst.exists()
    try:
        save_pretrained(pruned.cast(stored_dtype(source_hf)), dst, tokenizer=tokenizer_dir)
        after = config_to_hf(pruned.cfg)
        changed = {k: v for k, v in after.items() if before.get(k) != v or k == "head_dim"}
        changed |= {a: v for k, v in list(changed.items()) for a in ALIASES.get(k, ()) if a in source_hf}
        with atomic_output(dst / "config.json") as tmp:
            tmp.write_text(json.dumps(source_hf | changed, indent=2))
        if (src / "generation_config.json").is_file():
            shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")
    except BaseException:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise

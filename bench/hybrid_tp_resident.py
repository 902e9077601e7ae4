"""Resident bytes per rank of a hybrid model's recurrent mixers under tensor-parallel serving: the
weights training keeps whole on every rank (Qwen3.5's in_proj_qkv, Mamba-2's in_proj, every conv,
the heads' A_log / dt_bias / D, Mamba's norm) cut to the rank's part at load, against the cut that
keeps them whole and its parts beside them (`KeptParts`, what GRPO's engine over the trainer's shared
weights still does).

    PYTHONPATH=$PWD .venv/bin/python bench/hybrid_tp_resident.py --tp 2

For each preset, one recurrent layer at its published size (the MoE and the vocabulary shrunk: they
are cut alike either way) is cut over `--tp` forked gloo ranks both ways, runs one forward of 8
tokens (which fills `KeptParts`), and rank 0 sums the bytes of its mixer's parameters and kept parts
(each storage once). The model's figure is that times its recurrent layers. fp32; bf16 halves every
figure. Writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config import get_preset  # noqa: E402
from tests.forked_ranks import run_ranks  # noqa: E402

PRESETS = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "nemotron-h-8b")


def one_recurrent_layer(preset: str):
    """The preset with one decoder layer, its recurrent mixer at full size; two small experts, a small vocabulary."""
    cfg = get_preset(preset)
    small = dict(n_layers=1, vocab_size=1024, ffn_dim=256, mtp_depth=0,
                 nope_layers=[] if cfg.nope_layers else cfg.nope_layers)
    if cfg.moe is not None:  # a few small experts (the family needs its MoE section)
        groups = cfg.moe.n_groups or 1
        small["moe"] = dataclasses.replace(cfg.moe, num_experts=2 * groups, top_k=2, ffn_dim=64,
                                          shared_ffn_dim=64 if cfg.moe.shared_ffn_dim else 0,
                                          topk_groups=min(cfg.moe.topk_groups or 1, groups), dense_layers=[])
    if cfg.mamba is not None:
        return dataclasses.replace(cfg, sublayers=["mamba"], **small)
    return dataclasses.replace(cfg, linear_attention=dataclasses.replace(cfg.linear_attention, layers=[0]),
                               **small)


def _mixer_bytes(mixer) -> int:
    from tessera.infer.runner.tensor_parallel import KeptParts

    tensors = list(mixer.parameters())
    if isinstance(mixer.own_part, KeptParts):
        tensors += [out for _, _, out in mixer.own_part.kept.values()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _on_rank(preset: str, tp: int) -> dict:
    from tessera.infer.runner.tensor_parallel import cut_for_serving, serving_dims, shard_model, to_plain_tensors
    from tessera.models import Transformer

    cfg = one_recurrent_layer(preset)
    dims = serving_dims(cfg, tp)
    dims.build_mesh("cpu")
    ids = torch.arange(8)[None] % cfg.vocab_size
    out = {}
    with torch.no_grad():
        whole = Transformer(cfg, init_seed=0).eval()
        out["one_rank"] = _mixer_bytes(whole.layers["0"].attention)
        kept = to_plain_tensors(shard_model(whole, dims), dims["tp"].get_group())
        kept(ids)
        out["kept"] = _mixer_bytes(kept.layers["0"].attention)
        del kept, whole
        cut = cut_for_serving(Transformer(cfg, init_seed=0), dims)
        cut(ids)
        out["cut"] = _mixer_bytes(cut.layers["0"].attention)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    args = parser.parse_args()
    rows = {}
    for preset in args.presets:
        cfg = get_preset(preset)
        layers = sum(1 for i in range(cfg.n_layers) if cfg.is_linear_attention_layer(i) or cfg.is_mamba_layer(i))
        got = run_ranks(_on_rank, args.tp, preset, args.tp, timeout=600)[0]
        rows[preset] = {"recurrent_layers": layers, "per_layer_bytes": got,
                        "model_mib_per_rank": {k: v * layers / 2**20 for k, v in got.items()},
                        "cut_over_kept": got["cut"] / got["kept"], "cut_times_tp_over_one_rank": got["cut"] * args.tp
                        / got["one_rank"]}
    print(json.dumps({"tp": args.tp, "dtype": "fp32", "machine": platform.processor() or platform.machine(),
                      "torch": torch.__version__, "presets": rows}, indent=1))


if __name__ == "__main__":
    main()

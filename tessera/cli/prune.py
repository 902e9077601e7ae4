"""`tessera prune SRC DST [--target-params N] [--layers K] [--ffn-hidden-size F] [--num-heads H]
[--num-kv-heads G] [--experts E] [--hidden-size D] [--calibration DATA ...]`: a HuggingFace directory pruned to explicit
sizes or to a parameter target, written as a HuggingFace directory of the same family
(tessera/prune)."""

from __future__ import annotations

import argparse

from tessera.config.argument_types import int_in
from tessera.config.limits import MAX_DIM, MAX_EXPERTS, MAX_FFN_DIM, MAX_HEADS, MAX_LAYERS

# The explicit sizes: option, largest value, metavar, help. None keeps the source's (or leaves it to the search).
SIZE_OPTIONS = [
    ("--layers", MAX_LAYERS, "K", "keep the K layers whose output differs most from their input (None: all)"),
    ("--ffn-hidden-size", MAX_FFN_DIM, "F",
     "keep the F FFN channels of largest mean |activation| in each dense layer (None: all)"),
    ("--num-heads", MAX_HEADS, "H", "query heads to keep, a multiple of the KV groups kept (None: the source's, or "
     "with --num-kv-heads the source's heads per group times the groups kept)"),
    ("--num-kv-heads", MAX_HEADS, "G", "KV groups to keep, each with its query heads (None: the source's)"),
    ("--experts", MAX_EXPERTS, "E",
     "MoE: keep the E most routed experts of each MoE layer, at least top_k (None: all)"),
    ("--hidden-size", MAX_DIM, "D", "keep the D embedding channels of largest mean |RMSNorm output| summed over "
     "the norms, in every tensor that reads or writes the residual stream (None: all; never chosen by "
     "--target-params)"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a HuggingFace model directory of a family Tessera supports")
    p.add_argument("dst", help="the new directory to write the pruned model to (HuggingFace, same family)")
    p.add_argument("--target-params", type=int_in(1, 2**62), default=None, metavar="N",
                   help="shrink the sizes not given explicitly to at most N parameters: dense FFN to 1/2, experts to "
                        "1/2, then layers, then FFN to 1/16 and experts to top_k (None: only the sizes given)")
    for option, top, metavar, text in SIZE_OPTIONS:
        p.add_argument(option, type=int_in(1, top), default=None, metavar=metavar, help=text)
    add_calibration_arguments(p, "whose text ranks the parts")


def add_calibration_arguments(p: argparse.ArgumentParser, purpose: str) -> None:
    """--calibration DATA ..., --calibration-sequences, --calibration-length (prune, quantize)."""
    p.add_argument("--calibration", action="append", default=None, metavar="DATA",
                   help=f"text / JSONL files or directories {purpose} (repeatable; None: the bundled corpus, the "
                        "Python standard library's source)")
    p.add_argument("--calibration-sequences", type=int_in(1, 1_000_000), default=None, metavar="N",
                   help="calibration sequences (None: 16)")
    p.add_argument("--calibration-length", type=int_in(1, 1_000_000), default=None, metavar="S",
                   help="tokens per calibration sequence, at most the model's context (None: 256)")


def run(args: argparse.Namespace) -> int:
    from tessera.prune import PruneSizes, prune

    asked = PruneSizes(layers=args.layers, ffn_dim=args.ffn_hidden_size, n_heads=args.num_heads,
                       n_kv_heads=args.num_kv_heads, num_experts=args.experts, dim=args.hidden_size)
    result = prune(args.src, args.dst, asked, target_params=args.target_params, calibration=args.calibration,
                   num_sequences=args.calibration_sequences, seq_len=args.calibration_length)
    print(f"pruned {args.src} -> {result.path}")
    print(result.summary())
    return 0

"""`tessera convert SRC DST [--dtype D] [--tokenizer T] [--set parallel.K=V ...]`: a HuggingFace
directory <-> a Tessera checkpoint, or a GGUF file -> a HuggingFace directory, tokenizer included;
with `--set`, the checkpoint's chunks are that layout's shards. A run trained with train.lora:
`--lora-adapter` writes its PEFT adapter directory, `--merge-lora` its merged HuggingFace directory."""

from __future__ import annotations

import argparse

from tessera.config.dtypes import short_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a HuggingFace model directory, a Tessera run directory / checkpoint, or a GGUF file "
                                "(MODEL.gguf, written as a HuggingFace directory)")
    p.add_argument("dst", help="the directory to write (the other format)")
    p.add_argument("--dtype", default="fp32", type=short_dtype_argument, choices=["fp32", "bf16"],  # torch's names too
                   help="dtype of the written weights")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer written with the weights (Tessera -> HuggingFace) or recorded with them "
                        "(HuggingFace -> Tessera); None: the run's data.tokenizer, else the bundled one / the "
                        "HuggingFace directory's own / the GGUF file's own")
    p.add_argument("--set", dest="layout", action="append", default=[], metavar="parallel.KEY=VALUE",
                   help="HuggingFace -> Tessera: write the checkpoint cut into the shards of this parallel layout, "
                        "e.g. --set parallel.tp=2 --set parallel.dp_shard=4 (repeatable; parallel.* keys only; "
                        "give dp_shard explicitly, unset counts as 1)")


    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--lora-adapter", dest="lora", action="store_const", const="adapter", default=None,
                      help="SRC is a run trained with train.lora: write its adapters as a PEFT directory "
                           "(adapter_config.json, adapter_model.safetensors) over its HuggingFace base, which "
                           "peft, vLLM and `tessera serve BASE --lora NAME=DST` load")
    lora.add_argument("--merge-lora", dest="lora", action="store_const", const="merge", default=None,
                      help="SRC is a run trained with train.lora: write its model with the adapters merged into the "
                           "weights (a quantized base dequantized) as a HuggingFace directory")


def run(args: argparse.Namespace) -> int:
    from tessera.checkpoint.convert import convert
    from tessera.cli.notice import packaged_model

    kind, path = convert(packaged_model(args.src, "convert"), args.dst, args.dtype, tokenizer=args.tokenizer,
                         layout=args.layout, lora=args.lora)
    print(f"wrote {kind} directory {path}")
    return 0

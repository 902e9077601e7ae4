"""`write_int8_directory(src, dst)`: a pre-quantized (int8, weight-only) copy of a HuggingFace model
directory, which `tessera serve DST` loads without the full-precision weights.

The layers are those `EngineConfig.quantization="int8"` quantizes at load (`quantize_model`,
tessera/models/quantized.py: round-to-nearest, one scale per output channel); the directory is
Tessera's own format (tessera/checkpoint/int8.py), not compressed-tensors (`quantize`, run.py).
From the command line: `python -m tessera.quantize.int8_directory SRC DST`.
"""

from __future__ import annotations

import os

from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.int8 import save_quantized
from tessera.models.quantized import quantize_model


def write_int8_directory(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Write `dst`, the HuggingFace model `src` with its block layers int8; returns their names."""
    model = load_pretrained(src)
    layers = quantize_model(model, "int8")
    save_quantized(model, layers, dst, source_dir=src)
    return layers


def main(argv: list[str] | None = None) -> int:
    """`python -m tessera.quantize.int8_directory SRC_DIR OUT_DIR`: write a pre-quantized copy of a model."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tessera.quantize.int8_directory", description=main.__doc__)
    parser.add_argument("src", help="HuggingFace model directory")
    parser.add_argument("out", help="directory to write (serve it with `tessera serve OUT`)")
    args = parser.parse_args(argv)
    layers = write_int8_directory(args.src, args.out)
    print(f"wrote {args.out}: {len(layers)} int8 layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m tessera.infer.quant SRC OUT`: a pre-quantized (int8, weight-only) copy of a
HuggingFace model directory, which `tessera serve OUT` loads without the full-precision weights.

The int8 layers are tessera/models/int8.py, the directory format tessera/checkpoint/int8.py; the
engine quantizes at load with `quantize_model` (EngineConfig.quantization="int8").
"""

from __future__ import annotations

from tessera.checkpoint.int8 import save_quantized
from tessera.models.int8 import quantize_model


def main(argv: list[str] | None = None) -> int:
    """`python -m tessera.infer.quant SRC_DIR OUT_DIR`: write a pre-quantized copy of a model."""
    import argparse

    from tessera.checkpoint.hf.load import load_pretrained

    parser = argparse.ArgumentParser(prog="python -m tessera.infer.quant", description=main.__doc__)
    parser.add_argument("src", help="HuggingFace model directory")
    parser.add_argument("out", help="directory to write (serve it with `tessera serve OUT`)")
    args = parser.parse_args(argv)
    model = load_pretrained(args.src)
    layers = quantize_model(model)
    save_quantized(model, layers, args.out, source_dir=args.src)
    print(f"wrote {args.out}: {len(layers)} int8 layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

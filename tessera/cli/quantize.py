"""`tessera quantize SRC DST --method gptq|smoothquant|fp8|rtn [--calibration DATA ...]`: a HuggingFace
directory quantized once and written as a HuggingFace directory in compressed-tensors format
(tessera/quantize), which vLLM and transformers load. Each option says which methods it applies to;
given to another method (`--alpha` with gptq, `--dampening` with smoothquant, `--actorder` with
rtn) it is refused naming both, exit 2, rather than ignored."""

from __future__ import annotations

import argparse

from tessera.cli.prune import add_calibration_arguments
from tessera.config.argument_types import int_in

METHODS = ("gptq", "smoothquant", "fp8", "rtn")  # tessera.quantize.METHODS, without importing torch


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a HuggingFace model directory of a dense family Tessera supports")
    p.add_argument("dst", help="the new directory to write the quantized model to (compressed-tensors)")
    p.add_argument("--method", required=True, choices=METHODS,
                   help="gptq / rtn: int weights, group-wise (W4A16 by default); smoothquant: W8A8 int8 with "
                        "smoothing; fp8: e4m3 weights and activations (FP8_DYNAMIC)")
    add_calibration_arguments(p, "to calibrate gptq and smoothquant on")  # each refused with rtn and fp8
    p.add_argument("--bits", type=int, choices=(4, 8), default=None,
                   help="rtn, gptq: weight bits (None: 4)")
    p.add_argument("--group-size", type=int_in(0, 1 << 20), default=None, metavar="G",
                   help="rtn, gptq: inputs per scale, dividing every layer's inputs; 0: one scale per output "
                        "channel (None: 128)")
    p.add_argument("--actorder", action="store_true",
                   help="gptq: quantize columns by decreasing Hessian diagonal (groups and layout unchanged)")
    p.add_argument("--dampening", type=_fraction, default=None, metavar="F",
                   help="gptq: fraction of the Hessian's mean diagonal added to its diagonal (None: 0.01)")
    p.add_argument("--alpha", type=_fraction, default=None, metavar="A",
                   help="smoothquant: migration strength, s = max|X|^A / max|W|^(1-A) (None: 0.5)")


def run(args: argparse.Namespace) -> int:
    from tessera.cli.notice import notice_if_slow
    from tessera.quantize import QuantizeOptions, quantize

    options = QuantizeOptions(bits=args.bits, group_size=args.group_size, actorder=args.actorder,
                              dampening=args.dampening, alpha=args.alpha, calibration=args.calibration,
                              num_sequences=args.calibration_sequences, seq_len=args.calibration_length)
    calibrated = args.method in ("gptq", "smoothquant")
    data = ", ".join(args.calibration) if args.calibration else "the bundled corpus"
    text = (f"tessera quantize: loading {args.src}, then {args.method}" + (f" calibrated on {data}" if calibrated
                                                                          else "")
            + f", writing {args.dst}; this may take minutes")
    with notice_if_slow(text):
        result = quantize(args.src, args.dst, args.method, options)
    print(f"quantized {args.src} -> {result.path} ({args.method})")
    print(result.summary())
    return 0

"""`python -m tessera.infer.quant SRC OUT`: the first spelling of `python -m tessera.quantize.int8_directory`
(a pre-quantized int8 copy of a HuggingFace model directory), kept so that what calls it still works.
The quantizer is tessera/quantize/; nothing else lives here.
"""

from __future__ import annotations

from tessera.quantize.int8_directory import main

if __name__ == "__main__":
    raise SystemExit(main())

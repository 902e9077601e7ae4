"""Static quantization (`tessera quantize SRC DST --method gptq|smoothquant|fp8|rtn`): a HuggingFace
model directory quantized once and written in compressed-tensors format (llm-compressor's, which
vLLM and transformers load); and `write_int8_directory(src, dst)`, the same model with int8 block
layers in Tessera's own pre-quantized format, which `tessera serve` loads. Quantizing a model in
memory at load (`--quantization int8|fp8|int4`) is `tessera.models.quantized.quantize_model`.

- `formats`: the weight formats (int group-wise / per channel, packed; int8; e4m3), their
  tensors and the `quantization_config`;
- `gptq`: GPTQ for one layer (Frantar et al. 2022);
- `smoothquant`: SmoothQuant's smoothing folded into the RMSNorms (Xiao et al. 2022);
- `calibration`: the calibration inputs' statistics, and the block-by-block pass GPTQ uses;
- `writer`: the compressed-tensors directory;
- `run`: `quantize(src, dst, method, options)`;
- `int8_directory`: `write_int8_directory(src, dst)`.
"""

from tessera.quantize.int8_directory import write_int8_directory
from tessera.quantize.run import METHODS, QuantizeOptions, QuantizeResult, quantize

__all__ = ["METHODS", "QuantizeOptions", "QuantizeResult", "quantize", "write_int8_directory"]

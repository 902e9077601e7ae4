"""Pre-quantized HuggingFace directories (compressed-tensors, DeepSeek-V3 block FP8), loaded with
their quantized layers kept quantized: `schemes` reads quantization_config, `load` builds the model."""

"""GGUF files (llama.cpp's format): a model and its tokenizer from one file, dequantized at load
(or its block matrices kept quantized: `load_gguf(..., keep_quantized=True)`).

`reader.py` opens the file and gives the HuggingFace config and HuggingFace-named float32 tensors;
`load.py` builds the `Transformer`; `tokenizer.py` the tokenizer. `tessera.checkpoint.loading`
treats a GGUF file as one more kind of model source, and `tessera convert MODEL.gguf OUT` writes it
as a HuggingFace directory (`tessera.checkpoint.convert`).
"""

from tessera.checkpoint.gguf.load import load_gguf
from tessera.checkpoint.gguf.reader import ARCHITECTURES, TENSOR_TYPES, GGUFFile, is_gguf_path
from tessera.checkpoint.gguf.tokenizer import gguf_tokenizer

__all__ = ["ARCHITECTURES", "TENSOR_TYPES", "GGUFFile", "gguf_tokenizer", "is_gguf_path", "load_gguf"]

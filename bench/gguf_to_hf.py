"""A GGUF file as a HuggingFace directory of plain float32 weights, by transformers' GGUF loader
(which needs the `gguf` package), for `tessera eval` and the rest of Tessera to read.

    .venv/bin/pip install gguf
    .venv/bin/python bench/gguf_to_hf.py DIR_OF_GGUF FILE.gguf OUT_DIR

transformers dequantizes the GGUF tensors while loading; the model is then saved without its
quantizer and `quantization_config`, so OUT_DIR is an ordinary float32 checkpoint (its tokenizer
and chat template come from the GGUF metadata).
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the directory holding the GGUF file")
    parser.add_argument("gguf_file", help="the GGUF file's name inside that directory")
    parser.add_argument("output", help="the HuggingFace directory to write")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.directory, gguf_file=args.gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(args.directory, gguf_file=args.gguf_file)
    model.hf_quantizer = None  # the weights are dequantized already: save them as they are
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"{args.output}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()

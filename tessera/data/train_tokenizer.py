"""Train the small byte-level BPE tokenizer that ships with Tessera.

    python -m tessera.data.train_tokenizer OUT_DIR --vocab-size 4096

Byte-level BPE (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners",
section 2.2) starts from the 256 byte values, so any text encodes without unknown tokens, and
learns merges of frequent adjacent pairs (Sennrich et al. 2016). The training text is the
bundled standard-library corpus (`tessera.data.corpus`) unless `--corpus` names a JSONL file.

The output directory gets `tokenizer.json`, `tokenizer_config.json` (eos `<|endoftext|>`, pad
`<|pad|>`, and a chat template over `<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`), and
`training.json` recording how it was made. HuggingFace `transformers` loads the directory too.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tessera.data.atomic_write import atomic_output
from tessera.data.corpus import DEFAULT_CORPUS_BYTES, build_stdlib_corpus
from tessera.data.documents import iter_jsonl
from tessera.data.tokenizer import Tokenizer

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS)  # ids 0..5, in this order

# Each turn is `<|role|>\n content <|end|>\n`; generation starts after `<|assistant|>\n`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2,
                        show_progress: bool = False) -> Tokenizer:
    """A byte-level BPE tokenizer with Tessera's special tokens and chat template, trained on `texts`."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE)


def _jsonl_texts(path: Path) -> Iterator[str]:
    for _, record, _ in iter_jsonl(path):
        yield record["text"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera.data.train_tokenizer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path,
                        help="directory to write tokenizer.json and tokenizer_config.json into")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--corpus", type=Path, default=None,
                        help="JSONL file with a 'text' field (default: the bundled stdlib corpus)")
    parser.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES,
                        help="size cap of the bundled corpus")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        if args.corpus is None:
            stats = build_stdlib_corpus(Path(scratch) / "corpus.jsonl", args.corpus_bytes)
            corpus_path = Path(stats.path)
            provenance = {"source": "python stdlib", "python_version": platform.python_version(),
                          "max_bytes": args.corpus_bytes, "documents": stats.documents,
                          "text_bytes": stats.text_bytes, "sha256": stats.sha256}
        else:
            corpus_path = args.corpus
            provenance = {"source": str(args.corpus)}
        tokenizer = train_bpe_tokenizer(_jsonl_texts(corpus_path), args.vocab_size, args.min_frequency,
                                        show_progress=sys.stderr.isatty())
    tokenizer.save(args.out_dir)
    record = {"algorithm": "byte-level BPE", "vocab_size": tokenizer.vocab_size,
              "min_frequency": args.min_frequency, "special_tokens": list(SPECIAL_TOKENS),
              "corpus": provenance,
              "command": (f"python -m tessera.data.train_tokenizer OUT_DIR --vocab-size {args.vocab_size} "
                          f"--min-frequency {args.min_frequency} --corpus-bytes {args.corpus_bytes}")}
    with atomic_output(args.out_dir / "training.json") as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out_dir}: vocab {tokenizer.vocab_size}, eos id {tokenizer.eos_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

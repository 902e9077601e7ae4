"""`tessera preprocess INPUT ... --output PREFIX` (or `--bundled`): tokenize text or conversations
into an indexed dataset."""

from __future__ import annotations

import argparse

from tessera.config.argument_types import text
from tessera.config.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", help=".txt / .jsonl files or directories of them")
    p.add_argument("--output", default=None, help="dataset prefix to write (PREFIX.bin and PREFIX.idx)")
    p.add_argument("--tokenizer", default=None, help="tokenizer file or directory (None: the bundled one)")
    p.add_argument("--jsonl-field", default="text", type=text, help="field of each JSONL record holding the text")
    p.add_argument("--text-mode", default="document", choices=["document", "line"],
                   help="a .txt file is one document, or each non-empty line is one")
    p.add_argument("--no-eos", action="store_true", help="do not end documents with the eos token")
    p.add_argument("--sft", action="store_true",
                   help="inputs are conversations (JSONL messages or prompt/response): also write the "
                        "answer-only loss mask PREFIX.mask (train with data.kind=sft)")
    p.add_argument("--bundled", action="store_true",
                   help="prepare the bundled stdlib corpus under --cache-dir instead (prints its prefix)")
    p.add_argument("--cache-dir", default=None,
                   help="with --bundled: where to prepare it (None: data.cache_dir's default)")


def run(args: argparse.Namespace) -> int:
    from tessera.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    if args.bundled:
        from tessera.data.corpus import prepare_corpus_dataset
        from tessera.train.data_source import default_cache_dir

        print(prepare_corpus_dataset(args.cache_dir or default_cache_dir(), tokenizer, show_progress=True))
        return 0
    if not args.inputs or not args.output:
        raise ConfigError("preprocess needs INPUT files and --output PREFIX (or --bundled)")
    if args.sft:
        from tessera.data.sft import preprocess_sft

        stats = preprocess_sft(args.inputs, args.output, tokenizer)
        print(f"wrote {args.output}.bin/.idx and {args.output}.mask.bin/.idx: {stats.documents} conversations, "
              f"{stats.tokens} tokens")
        return 0
    from tessera.data.preprocess import preprocess

    stats = preprocess(args.inputs, args.output, tokenizer, jsonl_field=args.jsonl_field,
                       text_mode=args.text_mode, append_eos=not args.no_eos)
    print(f"wrote {args.output}.bin/.idx: {stats.documents} documents, {stats.tokens} tokens")
    return 0

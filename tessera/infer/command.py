"""`tessera serve MODEL_DIR [--port P] [--host 127.0.0.1] [--api-key K] ...`

`add_arguments(parser)` declares the options and `run(args)` serves until interrupted; the CLI
wires them as the `serve` subcommand. The defaults are the safe ones: bound to 127.0.0.1 and
answering only loopback Host names, request bodies up to 8 MiB, no adapter loading at run time.
`python -m tessera.infer.command MODEL_DIR ...` runs the same thing without the CLI.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from tessera.config.argument_types import int_in, port, positive_float, seed
from tessera.config.errors import TesseraError
from tessera.config.limits import MAX_KV_BLOCKS, MAX_KV_CACHE_GIB
from tessera.infer.http_guards import DEFAULT_MAX_REQUEST_BYTES


def batch_sizes(text: str) -> list[int]:
    """`--decode-batch-sizes`: comma-separated positive integers, or 'none' (the empty list)."""
    if text.strip().lower() == "none":
        return []
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 or b > 4096 for b in sizes):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers in 1..4096 or 'none', got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("model_dir", help="HuggingFace model directory, pre-quantized directory or Tessera checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="port to bind, 0..65535 (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics; /health stays open "
                        "(default: $TESSERA_API_KEY; an empty key is refused)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="comma list of Host header names to answer, '*' for any; others get 400 (protects "
                        "against DNS rebinding). Default: loopback names only when --host is a loopback "
                        "address, any name otherwise (set it when serving beyond this machine)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"refuse request bodies larger than N bytes with 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` clients send (default: MODEL_DIR as given; its absolute path and base name "
                        "are accepted too)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int_in(1, MAX_KV_BLOCKS), default=None,
                   help="KV-cache blocks (default: from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=positive_float(MAX_KV_CACHE_GIB), default=1.0)
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8"], help="store keys/values as int8")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one engine step")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + completion limit")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--system-prompt", action="append", default=[], metavar="TEXT",
                   help="prefill TEXT at start and keep its KV blocks cached (repeatable)")
    p.add_argument("--speculative", default=None, choices=["draft", "prompt_lookup"], help="speculative decoding")
    p.add_argument("--draft-model", default=None, help="draft model directory (with --speculative draft)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--quantization", default=None, choices=["int8"], help="int8 weight-only quantization at load")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve the PEFT adapter DIR under model name NAME (repeatable)")
    p.add_argument("--merge-lora", action="append", default=[], metavar="DIR",
                   help="merge the PEFT adapter DIR into the weights at load (repeatable)")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-modules-dir)")
    p.add_argument("--lora-modules-dir", action="append", default=[], metavar="DIR",
                   help="directory that runtime-loaded adapters must lie in, after resolving symlinks; a "
                        "relative lora_path is looked up inside it (repeatable)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the decode step eagerly instead of replaying CUDA graphs (no effect on CPU)")
    p.add_argument("--decode-batch-sizes", type=batch_sizes, default=None, metavar="B1,B2,...",
                   help="batch-size buckets of the static-shape decode step (default 1,2,4,... up to "
                        "--max-num-seqs; 'none': decode in the packed step)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_config(args: argparse.Namespace):
    from tessera.config.errors import ConfigError
    from tessera.infer.config import EngineConfig, SpeculativeConfig

    adapters = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r} is invalid: expected NAME=DIR")
        adapters[name] = path
    spec = None
    if args.speculative:
        spec = SpeculativeConfig(method=args.speculative, num_tokens=args.num_speculative_tokens,
                                 draft_model=args.draft_model)
    return EngineConfig(dtype=args.dtype, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_gib=args.kv_cache_gib, kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        system_prompts=list(args.system_prompt), speculative=spec, quantization=args.quantization,
                        lora_adapters=adapters, merge_lora=list(args.merge_lora), max_loras=args.max_loras,
                        seed=args.seed, enforce_eager=args.enforce_eager, decode_batch_sizes=args.decode_batch_sizes)


def _check_server_options(args: argparse.Namespace):
    """ConfigError for serving options that cannot work, before the model is loaded; returns the
    Host allow-list (None: any)."""
    from tessera.config.errors import ConfigError
    from tessera.infer.http_guards import allowed_hosts, check_api_key

    check_api_key(args.api_key)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is invalid: must be in 0..65535")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} is invalid: must be >= 1")
    if args.allow_runtime_lora and not args.lora_modules_dir:
        raise ConfigError("--allow-runtime-lora needs --lora-modules-dir DIR: the directories adapters may be "
                          "loaded from")
    if args.lora_modules_dir and not args.allow_runtime_lora:
        raise ConfigError("--lora-modules-dir has no effect without --allow-runtime-lora")
    for d in args.lora_modules_dir:
        if not Path(d).is_dir():
            raise ConfigError(f"--lora-modules-dir {d!r} is not a directory")
    return allowed_hosts(args.allowed_hosts, args.host)


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread and serve HTTP until interrupted; 2 on bad input."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        hosts = _check_server_options(args)
        import uvicorn

        from tessera.infer.engine import LLMEngine
        from tessera.infer.engine_loop import EngineLoop
        from tessera.infer.server import create_app

        engine = LLMEngine.from_dir(args.model_dir, engine_config(args))
    except TesseraError as e:
        print(f"tessera serve: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model_dir
    aliases = (args.model_dir, str(Path(args.model_dir).resolve()), Path(args.model_dir).resolve().name)
    loop = EngineLoop(engine).start()
    app = create_app(loop, name, api_key=args.api_key, allow_lora_loading=args.allow_runtime_lora, aliases=aliases,
                     lora_dirs=args.lora_modules_dir, max_request_bytes=args.max_request_bytes, allowed_hosts=hosts)
    print(f"tessera serve: {name!r} on http://{args.host}:{args.port} (max_model_len {engine.max_model_len}, "
          f"{engine.blocks.num_blocks} KV blocks of {engine.config.block_size}; answers Host "
          f"{'any' if hosts is None else ','.join(sorted(hosts))})", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        loop.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera serve", description="OpenAI-compatible server for a model")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

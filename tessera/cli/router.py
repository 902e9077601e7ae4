"""`tessera router --prefill URL --decode URL [--host 127.0.0.1] [--port P] [--api-key K]`: an
OpenAI-compatible front for a prefill instance (`tessera serve DIR --kv-role prefill`) and a decode
instance (`tessera serve DIR --kv-role decode --kv-offload-gib G`) of the same model
(`tessera.infer.fleet.router`), until interrupted. The three share a KV peer secret
(`--kv-peer-secret-file FILE` or $TESSERA_KV_PEER_SECRET; without either, when all three listen and
call on loopback, their user's own: kv_peer.py).

`tessera router --replica URL [--replica URL ...] [--policy cache_aware|round_robin|least_loaded]`:
one front for several replicas of the same models instead (`tessera.infer.fleet.replica_router`); with
`--prefill URL [--prefill URL ...]` beside them, a pool of prefill instances computes each prompt
for the chosen replica (then a `--kv-role decode` instance)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import urllib.parse

from tessera.cli.listening import add_listen_arguments, check_listen_options, listen_sockets
from tessera.config.argument_types import positive_float, text
from tessera.config.errors import ConfigError
from tessera.infer.scheduling.kv_peer import add_kv_peer_argument, read_kv_peer_secret


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", dest="prefills", action="append", default=[], metavar="URL", type=text,
                   help="the prefill instance, e.g. http://127.0.0.1:8001 (`tessera serve DIR --kv-role prefill`); "
                        "with --replica repeatable: a prefill pool in front of the replicas (decode instances)")
    p.add_argument("--decode", default=None, metavar="URL", type=text,
                   help="the decode instance (`tessera serve DIR --kv-role decode --kv-offload-gib G`)")
    p.add_argument("--replica", dest="replicas", action="append", default=[], metavar="URL", type=text,
                   help="a `tessera serve` replica (repeatable; instead of --prefill and --decode)")
    p.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin", "least_loaded"],
                   help="with --replica: where each request goes (tessera/infer/fleet/replica_router.py)")
    p.add_argument("--health-interval", type=positive_float(3600), default=5.0, metavar="S",
                   help="with --replica: seconds between health checks of the replicas")
    add_listen_arguments(
        p, api_key_help="require 'Authorization: Bearer KEY' (passed on to both instances: give them the same "
                        "key; default from $TESSERA_API_KEY)",
        allowed_hosts_help="comma list of Host header names to answer, '*' for any (None: loopback names when "
                           "bound to loopback, else any)")
    p.add_argument("--prefill-timeout", type=positive_float(3600), default=30.0, metavar="S",
                   help="seconds the prefill and the transfer of one request may take before the decode instance "
                        "computes the prompt itself")
    _deadline_arguments(p)
    add_kv_peer_argument(p, "the router and both instances")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the router's log level (failed prefills are warnings)")


def _deadline_arguments(p: argparse.ArgumentParser) -> None:
    """Each call to an instance is bounded by these (tessera/infer/fleet/router_relay.py)."""
    p.add_argument("--backend-connect-timeout", type=positive_float(3600), default=10.0, metavar="S",
                   help="seconds to connect to an instance (a miss: 504 naming it)")
    p.add_argument("--backend-first-byte-timeout", type=positive_float(86400), default=600.0, metavar="S",
                   help="seconds to an instance's response head; for an answer that is not streamed that is the "
                        "whole generation (a miss: 504 naming the instance)")
    p.add_argument("--backend-timeout", type=positive_float(7 * 86400), default=3600.0, metavar="S",
                   help="seconds an instance's whole answer may take; a stream past it ends with an error event")


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (exit 0); a bad option or a port in use is exit 2."""
    from tessera.infer.api.http_guards import allowed_hosts, is_loopback
    from tessera.infer.fleet.router import check_backends
    from tessera.infer.fleet.router_relay import Deadlines

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_listen_options(args)
    if args.replicas:
        return _run_replicas(args)
    if len(args.prefills) > 1:
        raise ConfigError("--prefill is repeatable with --replica only (a prefill pool); with --decode give one")
    if not args.prefills or args.decode is None:
        raise ConfigError("tessera router needs --replica URL (repeatable), or --prefill URL and --decode URL")
    args.prefill = args.prefills[0]
    check_backends(args.prefill, args.decode, args.host, args.port)
    hosts = allowed_hosts(args.allowed_hosts, args.host)
    backends = [urllib.parse.urlsplit(url).hostname or "" for url in (args.prefill, args.decode)]
    on_loopback = all(is_loopback(h) for h in [args.host, *backends])
    kv_peer_secret = read_kv_peer_secret(args.kv_peer_secret_file, args.api_key, on_loopback)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(s) for s in listen_sockets(args.host, args.port)]
        import uvicorn

        from tessera.infer.fleet.router import create_router

        app = create_router(args.prefill, args.decode, args.prefill_timeout, args.api_key, hosts,
                            args.max_request_bytes, kv_peer_secret=kv_peer_secret,
                            deadlines=Deadlines(args.backend_connect_timeout, args.backend_first_byte_timeout,
                                                args.backend_timeout))
        print(f"tessera router: on http://{args.host}:{socks[0].getsockname()[1]} (prefill {args.prefill}, "
              f"decode {args.decode})", file=sys.stderr, flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=socks[0].getsockname()[1],
                                               log_level=args.log_level, access_log=False))
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=socks)
    return 0


def _run_replicas(args: argparse.Namespace) -> int:
    """`--replica` mode: serve until interrupted (exit 0)."""
    from tessera.infer.api.http_guards import allowed_hosts, is_loopback
    from tessera.infer.fleet.router import check_urls
    from tessera.infer.fleet.router_relay import Deadlines

    if args.decode is not None:
        raise ConfigError("--replica and --decode are exclusive: with --prefill URL (repeatable) the replicas are "
                          "the decode instances")
    urls = check_urls([(url, "--replica") for url in args.replicas], args.host, args.port)
    prefills = check_urls([(url, "--prefill") for url in args.prefills], args.host, args.port)
    hosts = allowed_hosts(args.allowed_hosts, args.host)
    on_loopback = all(is_loopback(urllib.parse.urlsplit(u).hostname or "") for u in [*urls, *prefills]) \
        and is_loopback(args.host)
    secret = read_kv_peer_secret(args.kv_peer_secret_file, args.api_key, on_loopback) if prefills else None
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(s) for s in listen_sockets(args.host, args.port)]
        import uvicorn

        from tessera.infer.fleet.replica_router import ReplicaRouter, create_replica_router

        router = ReplicaRouter(urls, args.policy, Deadlines(args.backend_connect_timeout,
                                                            args.backend_first_byte_timeout, args.backend_timeout),
                               health_interval_s=args.health_interval, api_key=args.api_key, prefills=prefills,
                               kv_peer_secret=secret, prefill_timeout_s=args.prefill_timeout)
        app = create_replica_router(router, args.api_key, hosts, args.max_request_bytes)
        print(f"tessera router: on http://{args.host}:{socks[0].getsockname()[1]} ({args.policy} over "
              f"{', '.join(urls)}{', prefill pool ' + ', '.join(prefills) if prefills else ''})", file=sys.stderr,
              flush=True)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=socks[0].getsockname()[1],
                                               log_level=args.log_level, access_log=False))
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=socks)
    return 0

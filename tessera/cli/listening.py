"""What the two HTTP commands (`tessera serve`, `tessera router`) share: the options of where they
listen and whom they answer, and the sockets they listen on before anything slow starts."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket

from tessera.config.argument_types import port, text
from tessera.config.errors import ConfigError
from tessera.config.limits import MAX_REQUEST_BYTES
from tessera.infer.api.http_guards import DEFAULT_MAX_REQUEST_BYTES


def add_listen_arguments(p: argparse.ArgumentParser, api_key_help: str, allowed_hosts_help: str) -> None:
    """--host, --port, --api-key, --allowed-hosts and --max-request-bytes (the two helps each command words)."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port to listen on, 0..65535 (0: any free one)")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"), type=text, help=api_key_help)
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES", type=text, help=allowed_hosts_help)
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"refuse request bodies larger than N bytes with 413 (1..{MAX_REQUEST_BYTES})")


def check_listen_options(args: argparse.Namespace) -> None:
    """ConfigError for a listening option that cannot work (checked before anything starts)."""
    if not 1 <= args.max_request_bytes <= MAX_REQUEST_BYTES:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} is invalid: must be in 1..{MAX_REQUEST_BYTES}")


def listen_sockets(host: str, port: int) -> list[socket.socket]:
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

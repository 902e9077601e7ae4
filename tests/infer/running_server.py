"""A real uvicorn server on a free 127.0.0.1 port, in a thread of the test process."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import threading
import time

import httpx
import uvicorn

from tessera.cli import main as tessera_main
from tessera.infer.api.server import create_app
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.loop import EngineLoop
from tests.hang_guard import HANG_S


def serve_main(argv: list[str]) -> int:
    """`tessera serve ARGV` in this process; its exit status."""
    return tessera_main(["serve", *argv])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_url(proc: subprocess.Popen, timeout: float = HANG_S) -> str:
    """The URL a `tessera serve ... --port 0` process (stdout piped) says it listens on; fail with
    its output if it exits first or says nothing within `timeout` seconds. Reads the pipe's file
    descriptor itself, so a later `proc.stdout.read()` returns the rest."""
    deadline, out = time.monotonic() + timeout, b""
    while (found := re.search(rb" on (http://\S+:\d+) ", out)) is None:
        left = deadline - time.monotonic()
        assert left > 0, f"no 'on http://HOST:PORT' line within {timeout} s: {out.decode()}"
        if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"exited with {proc.wait(HANG_S)} before serving: {out.decode()}")
            out += chunk
    return found.group(1).decode()


def stop_serving(proc: subprocess.Popen) -> None:
    """Ctrl-C to a `tessera serve` process started with stdout piped: it stops cleanly (status 0, no
    traceback in its output)."""
    proc.send_signal(signal.SIGINT)
    status = proc.wait(HANG_S)
    out = proc.stdout.read().decode()
    assert status == 0 and "Traceback" not in out, out


def terminate_if_running(proc: subprocess.Popen) -> None:
    """A served process a failed test left running is stopped."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(HANG_S)


def wait_until_serving(proc: subprocess.Popen, url: str, timeout: float = HANG_S) -> None:
    """Wait for a `tessera serve` process started with stdout piped to answer `url`/health; fail
    with its output if it exits first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            out = proc.stdout.read()
            raise AssertionError(out.decode() if isinstance(out, bytes) else out)
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)


class AppServer:
    """Any ASGI `app` served by uvicorn on a free 127.0.0.1 port, in a thread of the test process;
    `close` runs after the server stopped (what the app holds: an engine loop, a registry)."""

    def __init__(self, app, close=None):
        self.socket = socket.create_server(("127.0.0.1", 0))  # bound now: no other process can take the port
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self._close = close

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + HANG_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_S)
        self.socket.close()
        if self._close is not None:
            self._close()


class RunningServer(AppServer):
    def __init__(self, engine: LLMEngine, name: str = "tiny", api_key: str | None = None,
                 allow_lora_loading: bool = False, **app_options):
        """`app_options`: create_app's other keywords (lora_dirs, max_request_bytes, allowed_hosts)."""
        self.loop = EngineLoop(engine).start()
        self.engine = engine
        app = create_app(self.loop, name, api_key=api_key, allow_lora_loading=allow_lora_loading, **app_options)
        super().__init__(app, close=self.loop.stop)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once the engine has no request left (aborts are processed asynchronously)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.has_unfinished() and not self.loop._inbox.qsize():
                return True
            time.sleep(0.02)
        return False


def prefix_hit_tokens(url: str) -> int:
    """The server's `/metrics` count of prompt tokens found in the prefix cache so far."""
    text = httpx.get(url + "/metrics", timeout=HANG_S).text
    [line] = [line for line in text.splitlines() if line.startswith("tessera_prefix_cache_hit_tokens_total ")]
    return int(float(line.split()[1]))

"""A real uvicorn server on a free 127.0.0.1 port, in a thread of the test process."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from tessera.infer.engine import LLMEngine
from tessera.infer.engine_loop import EngineLoop
from tessera.infer.server import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, engine: LLMEngine, name: str = "tiny", api_key: str | None = None,
                 allow_lora_loading: bool = False, **app_options):
        """`app_options`: create_app's other keywords (lora_dirs, max_request_bytes, allowed_hosts)."""
        self.loop = EngineLoop(engine).start()
        self.engine = engine
        app = create_app(self.loop, name, api_key=api_key, allow_lora_loading=allow_lora_loading, **app_options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.stop()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once the engine has no request left (aborts are processed asynchronously)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.has_unfinished() and not self.loop._inbox.qsize():
                return True
            time.sleep(0.02)
        return False

"""A request that outlives `tessera serve`'s graceful shutdown ends as the server's decision, not a
traceback: a vision-language server SIGTERM'd while a chat request still fetches its image (the
stage a text request does not have) answers that request 503 "shutting down", logs one line and
exits 0 with no traceback in its output."""

from __future__ import annotations

import http.server
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.hang_guard import HANG_S
from tests.infer.running_server import serving_url, terminate_if_running, wait_until_serving

ROOT = Path(__file__).resolve().parents[2]


def _stalling_image_host(fetching: threading.Event, release: threading.Event) -> http.server.ThreadingHTTPServer:
    """An image host that answers its headers, then holds the body until `release`."""

    class Stall(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.flush()
            fetching.set()
            release.wait(HANG_S)

        def log_message(self, *args):
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stall)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    return host


@pytest.mark.slow
def test_a_sigterm_with_an_image_request_in_flight_exits_cleanly(llava):
    path, _ = llava
    fetching, release = threading.Event(), threading.Event()
    host = _stalling_image_host(fetching, release)
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", str(path), "--port", "0", "--block-size", "4",
                             "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "3600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    answers = []
    try:
        url = serving_url(proc)
        wait_until_serving(proc, url)
        image = f"http://127.0.0.1:{host.server_address[1]}/cat.png"
        body = {"model": str(path), "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "what?"}]}]}
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(url + "/v1/chat/completions", json=body, timeout=HANG_S)))
        client.start()
        assert fetching.wait(HANG_S)
        proc.send_signal(signal.SIGTERM)
        client.join(HANG_S)  # answered once the graceful shutdown has given up on it
        release.set()  # the fetch ends, and with it the thread that did it
        status = proc.wait(HANG_S)
        out = proc.stdout.read().decode()
    finally:
        release.set()
        terminate_if_running(proc)
        host.shutdown()
    assert status == 0 and "Traceback" not in out, out
    assert answers and answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]
    assert out.count("cancelled: the server is shutting down") == 1, out


@pytest.mark.parametrize("started", [False, True])
def test_a_cancelled_request_ends_with_a_503_or_the_end_of_its_stream(started):
    """What the wrapper sends when uvicorn cancels a request's task: a 503 before any response, the
    end of the body of a stream that has begun; the cancellation goes no further."""
    import asyncio

    from tessera.infer.api.shutdown import EndCancelledRequests

    sent = []

    async def app(scope, receive, send):
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.Event().wait()  # never done: the server cancels it

    async def send(message):
        sent.append(message)

    async def main():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
        task = asyncio.create_task(EndCancelledRequests(app)(scope, None, send))
        await asyncio.sleep(0)
        task.cancel()
        await task  # ended, not cancelled further

    asyncio.run(main())
    if started:
        assert [m.get("more_body", False) for m in sent[1:]] == [True, False] and sent[-1]["body"] == b""
    else:
        assert sent[0]["status"] == 503 and b"shutting down" in sent[1]["body"]

"""`tessera router` under broken and hostile backends, over real sockets on 127.0.0.1: a decode
instance that accepts and never answers (a 504 naming it, after its deadline), one that resets in the
middle of a streamed answer (the client's stream ends with an error event, the log has one line and
no traceback), a router pointed at itself or at a router leading back to it (508 at once, or refused
at start-up), bodies nested too deeply to parse (the decode instance's 400, never a 500), and the
bounds of the router's options. Deadlines here are the router's own, set short; the test's waits are
hang guards."""

import contextlib
import json
import logging
import socket
import struct
import threading
import time

import httpx
import pytest
import uvicorn

from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.fleet.router import create_router
from tessera.infer.fleet.router_relay import Deadlines
from tessera.infer.scheduling.kv_peer import PEER_SIGNATURE_HEADER, sign_prefill_request
from tests.infer.running_server import RunningServer, free_port

HANG_S = 20.0
SECRET = b"k" * 32

DEEP = b"[" * 100_000 + b"]" * 100_000
BODY = {"model": "tiny", "prompt": "a", "max_tokens": 2}


class _Backend:
    """A TCP server on 127.0.0.1 answering each connection with `talk(conn, request_head)` in a thread."""

    def __init__(self, talk):
        self.talk, self.listener = talk, socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed, self.connections = threading.Event(), []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536) or b"\r\n\r\n"
            self.talk(self, conn, head)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.closed.set()
        self.listener.close()
        for conn in self.connections:
            conn.close()


def _silent(backend: _Backend, conn: socket.socket, head: bytes) -> None:
    backend.closed.wait(HANG_S)  # accepted, read, never answered


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


EVENT = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _resets_mid_stream(backend: _Backend, conn: socket.socket, head: bytes) -> None:
    """One event and half of the next, then a TCP reset (SO_LINGER 0)."""
    conn.sendall(SSE_HEAD + _chunk(EVENT) + _chunk(b'data: {"choices": [{"ind'))
    time.sleep(0.2)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _resets_mid_body(backend: _Backend, conn: socket.socket, head: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"id\":")
    time.sleep(0.2)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _trickles_events(backend: _Backend, conn: socket.socket, head: bytes) -> None:
    conn.sendall(SSE_HEAD)
    while not backend.closed.wait(0.2):
        conn.sendall(_chunk(EVENT))


def _answers_400(backend: _Backend, conn: socket.socket, head: bytes) -> None:
    body = b'{"error": {"message": "the decode instance says no", "code": 400}}'
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@contextlib.contextmanager
def _router(decode: str, prefill: str | None = None, port: int = 0, **options):
    """A router in a thread of this process (its log records reach caplog); yields its URL."""
    sock = socket.create_server(("127.0.0.1", port))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = create_router(prefill or f"http://127.0.0.1:{free_port()}", url if decode == "self" else decode,
                        kv_peer_secret=SECRET, **options)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the router did not start"
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(HANG_S)
        sock.close()


def _events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=HANG_S) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_decode_instance_that_never_answers_is_a_504_naming_it():
    with _Backend(_silent) as decode, _router(decode.url, deadlines=Deadlines(first_byte_s=0.5)) as url:
        for body in (BODY, {**BODY, "stream": True}):
            r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
            assert r.status_code == 504, r.text
            message = r.json()["error"]["message"]
            assert decode.url in message and "--backend-first-byte-timeout" in message, message
    with _Backend(_trickles_events) as decode, _router(decode.url, deadlines=Deadlines(whole_s=1.0)) as url:
        events = _events(url, BODY)  # ends, though the instance never stops sending
        error = json.loads(events[-2])["error"]
        assert error["code"] == 504 and decode.url in error["message"] and "--backend-timeout" in error["message"]
        assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "a"
    unreachable = f"http://127.0.0.1:{free_port()}"
    with _router(unreachable) as url:
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=HANG_S)
        assert r.status_code == 502 and unreachable in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/health", timeout=HANG_S).status_code == 503


def test_a_reset_ends_the_clients_stream_with_an_error_event_and_one_log_line(caplog):
    caplog.set_level(logging.WARNING)
    with _Backend(_resets_mid_stream) as decode, _router(decode.url) as url:
        events = _events(url, BODY)
    assert json.loads(events[0])["choices"][0]["text"] == "a"  # the whole event; the half one is dropped
    error = json.loads(events[1])["error"]
    assert error["code"] == 502 and decode.url in error["message"], error
    assert events[2:] == ["[DONE]"]
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    lines = [r for r in caplog.records if r.name == "tessera.router" and "error event" in r.getMessage()]
    assert len(lines) == 1 and decode.url in lines[0].getMessage()
    with _Backend(_resets_mid_body) as decode, _router(decode.url) as url:
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=HANG_S)
    assert r.status_code == 502 and decode.url in r.json()["error"]["message"], r.text
    assert not [r for r in caplog.records if r.exc_info]


def test_a_router_that_leads_back_to_itself_answers_508_at_once():
    with _router("self") as url:
        for r in (httpx.post(url + "/v1/completions", json=BODY, timeout=HANG_S),
                  httpx.get(url + "/health", timeout=HANG_S)):
            assert r.status_code == 508 and "request loop" in r.json()["error"]["message"], r.text
    port_a, port_b = free_port(), free_port()  # two routers, each the other's decode instance
    with _router(f"http://127.0.0.1:{port_b}", port=port_a) as a_url, \
            _router(f"http://127.0.0.1:{port_a}", port=port_b):
        r = httpx.post(a_url + "/v1/completions", json={**BODY, "stream": True}, timeout=HANG_S)
        assert r.status_code == 508 and "came back to this router" in r.json()["error"]["message"], r.text


def test_tessera_router_refuses_its_own_address_and_bad_bounds(capsys):
    from tessera.cli import main

    port = free_port()
    for decode in (f"http://127.0.0.1:{port}", f"http://localhost:{port}/"):
        assert main(["router", "--prefill", "http://127.0.0.1:1", "--decode", decode, "--port", str(port)]) == 2
        assert f"--decode {decode} is this router's own address" in capsys.readouterr().err
    assert main(["router", "--prefill", f"http://127.0.0.1:{port}", "--decode", "http://127.0.0.1:1", "--host",
                 "0.0.0.0", "--port", str(port)]) == 2
    assert "--prefill" in capsys.readouterr().err
    assert main(["router", "--prefill", "http://127.0.0.1:99999", "--decode", "http://127.0.0.1:1"]) == 2
    assert "--prefill 'http://127.0.0.1:99999' is invalid" in capsys.readouterr().err
    for command in (["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
                    ["serve", "model-dir"]):
        for value in ("-1", "0", str(2**31 + 1)):
            assert main([*command, "--max-request-bytes", value]) == 2
            assert f"--max-request-bytes {value} is invalid" in capsys.readouterr().err
    for option, value in (("--backend-timeout", "0"), ("--backend-connect-timeout", "nan"),
                          ("--backend-first-byte-timeout", "-5")):
        with pytest.raises(SystemExit) as exit_:
            main(["router", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", option, value])
        assert exit_.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_bodies_nested_too_deeply_get_the_decode_instances_400(caplog):
    with _Backend(_answers_400) as decode, _router(decode.url) as url:
        for body in (DEEP, b'{"model": "tiny", "prompt": "a", "user": ' + DEEP + b"}"):
            r = httpx.post(url + "/v1/completions", content=body, timeout=HANG_S,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400 and "the decode instance says no" in r.text, r.text
        assert "tessera_router_prefill_fallbacks_total 2" in httpx.get(url + "/metrics", timeout=HANG_S).text
    assert not [r for r in caplog.records if r.exc_info]


def test_a_prefill_instance_takes_what_it_could_parse_without_a_500(llama):
    """A request nested as deeply as parsing allows (how deep that is depends on the stack the
    parser runs on): the prefill instance answers 200 or 400 at every depth, never a 500."""
    engine = LLMEngine.from_dir(llama[0], EngineConfig(block_size=4, num_blocks=64, kv_role="prefill"))
    with RunningServer(engine, name="tiny", kv_role="prefill", kv_peer_secret=SECRET) as server:
        statuses = set()
        for depth in range(900, 1000, 5):
            inner = '{"model": "tiny", "prompt": "abcdefgh", "user": %s}' % ("[" * depth + "]" * depth)
            body = f'{{"endpoint": "completions", "request": {inner}}}'.encode()
            r = httpx.post(server.url + "/v1/kv/prefill", content=body, timeout=HANG_S,
                           headers={PEER_SIGNATURE_HEADER: sign_prefill_request(SECRET, body)})
            statuses.add(r.status_code)
            assert r.status_code in (200, 400), (depth, r.status_code, r.text[:200])
        assert statuses == {200, 400}  # both sides of the parser's limit were tried

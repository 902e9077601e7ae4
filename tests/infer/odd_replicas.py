"""Real HTTP servers on 127.0.0.1 that misbehave as a router's replicas can: one that answers
garbage, one that hangs up after reading a request, one that dies mid-stream, and one that holds
each request until the test lets it go (to load replicas deterministically). Each answers
GET /health with 200 and GET /v1/models with the model "tiny", as a replica that looks alive would."""

from __future__ import annotations

import json
import socket
import threading

from tests.hang_guard import HANG_S

ANSWER = {"id": "cmpl-held", "object": "text_completion", "model": "tiny",
          "choices": [{"index": 0, "text": "held", "finish_reason": "length"}]}


def _read_request(conn: socket.socket) -> str:
    """The request's first line, its head and body read off the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return ""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head.split(b"\r\n")[0].decode()


def _reply(conn: socket.socket, body: bytes, content_type: bytes = b"application/json") -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}".encode() + b"\r\n" + data + b"\r\n"


class OddReplica:
    """`mode`: "garbage" (200, application/json, a body that is not JSON), "hang_up" (closes the
    connection after reading the request), "breaks_stream" (starts a stream, then closes) or "hold"
    (answers ANSWER once `release` is set)."""

    def __init__(self, mode: str):
        self.mode, self.release = mode, threading.Event()
        self.held = 0  # requests received and not yet answered
        self.received = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> OddReplica:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            line = _read_request(conn)
            if line.startswith("GET /health"):
                _reply(conn, b'{"status": "ok"}')
                return
            if line.startswith("GET /v1/models"):
                _reply(conn, b'{"object": "list", "data": [{"id": "tiny", "object": "model"}]}')
                return
            self.received += 1
            if self.mode == "garbage":
                _reply(conn, b"<html>this is not JSON")
            elif self.mode == "hold":
                self.held += 1
                self.release.wait(HANG_S)
                self.held -= 1
                _reply(conn, json.dumps(ANSWER).encode())
            elif self.mode == "breaks_stream":  # one event of a stream, then the connection is lost
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
                             b"\r\n\r\n" + _chunk(b'data: {"choices": [{"index": 0, "text": "half"}]}\n\n'))
            # "hang_up": the connection closes here, nothing answered

"""Images through the OpenAI chat API over real HTTP on 127.0.0.1: `image_url` parts as data: URLs,
local files under --allowed-local-media-path, http(s) from --allowed-media-domains; every bad
image or url fails only its own request with a 400 naming the problem, echoing nothing of the
server's files; image hosts that trickle bytes hold up no other request, are cut off at the fetch's
deadline and take at most --max-media-fetches slots; --limit-mm-per-prompt as vLLM spells it."""

import argparse
import asyncio
import base64
import http.server
import os
import socket
import threading
import time

import httpx
import pytest

from tessera.infer import EngineConfig, LLMEngine
from tessera.infer.api.media import MediaPolicy
from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.engine_arguments import mm_limits
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tiny_llava import IMAGE, hf_greedy, images, png
from tests.infer.tiny_models import char_tokenizer

TRUNCATED = png(images()[0])[:60]
# More pending fetches than the worker threads of the server's event loop (asyncio's default
# executor: min(32, cores + 4)), which parse and tokenise every request: were a fetch to hold one,
# these would hold them all.
TRICKLING = min(32, (os.cpu_count() or 1) + 4) + 2


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.invalid/x.png")
            self.end_headers()
            return
        if self.path == "/missing.png":
            self.send_error(404)
            return
        body = b"\0" * 60_000 if self.path == "/big.png" else png(images()[1])
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def server(llava, tmp_path_factory, image_host):
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(png(images()[0]))
    (media / "notes.png").write_bytes(b"SECRET server notes, not an image")
    outside = tmp_path_factory.mktemp("outside")
    (outside / "cat.png").write_bytes(png(images()[0]))
    path, _ = llava
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, limit_mm_per_prompt={"image": 2}))
    policy = MediaPolicy(str(media), ["127.0.0.1"], max_image_bytes=50_000, fetch_timeout_s=HANG_S,
                         max_fetches=TRICKLING)
    with RunningServer(engine, name="tiny", media=policy) as s:
        s.media, s.outside = media, outside
        yield s


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(server, parts: list, max_tokens: int = 5):
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG_S)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_with_images_equals_transformers(server, llava, image_host):
    _, hf = llava
    parts = [{"type": "text", "text": "see "}, image_part(data_url(png(images()[0]))), {"type": "text", "text": "!"},
             image_part(f"{image_host}/b.png")]
    r = chat(server, parts, max_tokens=6)
    assert r.status_code == 200, r.text
    tok = char_tokenizer()
    def enc(text):
        return tok.encode(text, add_special_tokens=False).ids

    ids = enc("<user>see ") + [IMAGE] + enc("!") + [IMAGE] + enc("\n<assistant>")
    want = hf_greedy(hf, ids, images(), 6)
    assert tok.encode(r.json()["choices"][0]["message"]["content"], add_special_tokens=False).ids == want
    assert r.json()["usage"]["prompt_tokens"] == len(ids) - 2 + 2 * server.engine.vision.cfg.image_tokens
    local = chat(server, [image_part(f"file://{server.media / 'cat.png'}"), {"type": "text", "text": "?"}])
    assert local.status_code == 200, local.text


@pytest.mark.parametrize("url, problem", [
    (data_url(b"hello, not an image"), "not an image"),
    (data_url(TRUNCATED), "truncated"),
    ("data:image/png;base64,@@@", "invalid base64"),
    ("ftp://127.0.0.1/x.png", "scheme must be"),
    ("http://example.com/cat.png", "not in --allowed-media-domains"),
    ("file:///tmp/%00cat.png", "NUL character"),
    ("file:///tmp/\0cat.png", "NUL character"),
    ("http://[::1/cat.png", "not a valid url"),
    ("http://127.0.0.1:99999/cat.png", "not a valid url"),
])
def test_bad_images_fail_only_their_request_with_400(server, url, problem):
    r = chat(server, [image_part(url)])
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
    assert chat(server, [{"type": "text", "text": "still fine"}]).status_code == 200


def test_decompression_bombs_and_large_images_are_refused(server):
    from tests.data.test_image_processor import _png_header

    r = chat(server, [image_part(data_url(_png_header(200_000, 200_000)))])
    assert r.status_code == 400 and "decompression bomb" in r.json()["error"]["message"], r.text
    r = chat(server, [image_part(data_url(b"\0" * 60_000))])
    assert r.status_code == 400 and "larger than 50,000 bytes" in r.json()["error"]["message"], r.text


def test_local_files_only_under_the_allowed_path_and_never_echoed(server):
    r = chat(server, [image_part(f"file://{server.outside / 'cat.png'}")])
    assert r.status_code == 400 and "outside --allowed-local-media-path" in r.text
    r = chat(server, [image_part(f"file://{server.media / '..' / server.outside.name / 'cat.png'}")])
    assert r.status_code == 400 and "outside --allowed-local-media-path" in r.text
    r = chat(server, [image_part(f"file://{server.media / 'notes.png'}")])
    assert r.status_code == 400 and "not an image" in r.text and "SECRET" not in r.text
    r = chat(server, [image_part(f"file://{server.media / 'missing.png'}")])
    assert r.status_code == 400 and "no readable file" in r.text


def test_http_images_redirects_errors_and_size(server, image_host):
    r = chat(server, [image_part(f"{image_host}/moved")])
    assert r.status_code == 400 and "redirects" in r.text, r.text
    r = chat(server, [image_part(f"{image_host}/missing.png")])
    assert r.status_code == 400 and "answered HTTP 404" in r.text, r.text
    r = chat(server, [image_part(f"{image_host}/big.png")])
    assert r.status_code == 400 and "larger than 50,000 bytes" in r.text, r.text


class _Trickle:
    """An image host on 127.0.0.1 that answers every GET with the head of a 40,000-byte image, then
    one byte of it every 0.2 s until it is closed: a fetch from it lasts as long as the test wants."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/slow.png"
        self.closed, self.connections = threading.Event(), []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            while b"\r\n\r\n" not in conn.recv(65536):
                pass
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 40000\r\n\r\n")
            while not self.closed.wait(0.2):
                conn.sendall(b"\0")
        except OSError:  # the fetch gave up
            pass

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + HANG_S
        while len(self.connections) < count:
            assert time.monotonic() < deadline, f"{len(self.connections)} of {count} fetches reached the host"
            time.sleep(0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.closed.set()
        self.listener.close()
        for conn in self.connections:
            conn.close()


def test_trickling_image_hosts_hold_up_no_other_request(server):
    """TRICKLING chats whose image host sends a byte now and then: while every fetch is pending, a
    text chat is answered, and one more image fetch is refused at once (503, --max-media-fetches);
    when the host goes away, each of the pending ones fails alone with a 400."""
    answers: list[httpx.Response] = []
    with _Trickle() as host:
        pending = [threading.Thread(target=lambda: answers.append(chat(server, [image_part(host.url)])))
                   for _ in range(TRICKLING)]
        for thread in pending:
            thread.start()
        host.wait_for(TRICKLING)
        r = chat(server, [{"type": "text", "text": "meanwhile"}])
        assert r.status_code == 200, r.text
        r = chat(server, [image_part(host.url)])
        assert r.status_code == 503 and "--max-media-fetches" in r.json()["error"]["message"], r.text
        assert not answers  # the fetches were pending all along
    for thread in pending:
        thread.join(HANG_S)
    assert len(answers) == TRICKLING
    assert all(a.status_code == 400 and "could not be fetched" in a.text for a in answers), answers[0].text


def test_the_fetch_timeout_bounds_the_whole_fetch():
    policy = MediaPolicy(None, ["127.0.0.1"], fetch_timeout_s=0.5)
    with _Trickle() as host, pytest.raises(ProtocolError, match=r"timed out.*--media-fetch-timeout"):
        asyncio.run(policy.fetch_all([host.url]))
    assert policy._in_flight == 0


def test_too_many_images_and_malformed_parts(server):
    url = data_url(png(images()[0]))
    r = chat(server, [image_part(url)] * 3)
    assert r.status_code == 400 and "at most 2 per prompt" in r.text
    r = chat(server, [{"type": "image_url", "image_url": {"href": url}}])
    assert r.status_code == 400 and "an image_url part needs" in r.text
    r = chat(server, [{"type": "audio", "data": "x"}])
    assert r.status_code == 400 and "got type 'audio'" in r.text


def test_limit_mm_per_prompt_is_spelled_as_vllm_spells_it():
    assert mm_limits("image=2") == {"image": 2}
    assert mm_limits('{"image": 3}') == {"image": 3}
    for bad in ("video=1", "image=-1", "image", '{"image": "many"}'):
        with pytest.raises(argparse.ArgumentTypeError, match="modalities: image"):
            mm_limits(bad)


def test_tessera_serve_refuses_what_it_cannot_serve_for_llava(llava, capsys, tmp_path):
    from tests.infer.running_server import serve_main

    path = str(llava[0])
    assert serve_main([path, "--port", "0", "--tensor-parallel-size", "2"]) == 2
    assert "tensor_parallel_size=2 is invalid: not supported for the vision-language model family 'llava'" in \
        capsys.readouterr().err
    assert serve_main([path, "--port", "0", "--allowed-local-media-path", str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        serve_main([path, "--limit-mm-per-prompt", "video=1"])
    assert exit_.value.code == 2 and "modalities: image" in capsys.readouterr().err

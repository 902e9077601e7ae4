"""Images of chat requests: OpenAI's `image_url` content parts, fetched only from allowed places.

A chat message's content may be a list of parts, `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ...}}` (OpenAI's chat format; the url may also be the
part's `image_url` string). `chat_images` collects the urls and puts a per-request marker in the
message text where each image goes; the server tokenizes around the markers and puts the model's
image token there. `MediaPolicy.fetch` reads the bytes of one url, as vLLM's options allow:

- `data:` URLs (base64) always;
- `file://` URLs only under `allowed_local_media_path` (vLLM's `--allowed-local-media-path`; off by
  default), the path resolved (links followed) before the check;
- `http://` / `https://` only from hosts named in `allowed_media_domains` (vLLM's
  `--allowed-media-domains`; none by default), no redirects, at most `max_image_bytes` read, and
  within `fetch_timeout_s` for the whole fetch: connecting, the answer's head and every byte of its
  body (a host that trickles bytes is cut off at the deadline, not only one that stops).

`MediaPolicy.fetch_all` is a coroutine: the server awaits it on its event loop between parsing a
request and tokenising it (both in worker threads), so a slow image host holds no thread that
other requests or the engine need. At most `max_fetches` http(s) fetches are in flight at once,
over all requests; a request that would start one more is refused at once with 503 (it may retry)
instead of queueing behind them.

Every refusal of the url or of what it holds is a `ProtocolError` (HTTP 400, param `messages`)
naming the problem and what is allowed; it quotes the client's url shortly and never anything read
from the server's files.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.api.quoting import brief

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # one image's encoded bytes, whichever way it comes
DEFAULT_FETCH_TIMEOUT_S = 10.0  # one http(s) fetch, whole: connect, head and body
DEFAULT_MAX_FETCHES = 16  # http(s) fetches in flight at once, over all requests


def chat_images(body: dict, marker: str) -> tuple[list[dict[str, str]], list[str]]:
    """The chat messages with text content (each image part replaced by `marker`) and the images'
    urls in order."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    out, urls = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProtocolError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content", "")
        if isinstance(content, list):
            content = "".join(_part_text(i, j, part, marker, urls) for j, part in enumerate(content))
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content must be a string or a list of parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out, urls


def _part_text(i: int, j: int, part: Any, marker: str, urls: list[str]) -> str:
    where = f"messages[{i}].content[{j}]"
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ProtocolError(f"{where}: an image_url part needs {{'image_url': {{'url': '...'}}}}",
                                param="messages")
        urls.append(url)
        return marker
    raise ProtocolError(f"{where}: parts are {{'type': 'text', 'text': ...}} or {{'type': 'image_url', "
                        f"'image_url': {{'url': ...}}}}; got type {brief(kind)}", param="messages")


def _bad_url(url: str, problem: str, status: int = 400) -> ProtocolError:
    return ProtocolError(f"image url {brief(url)}: {problem}", status=status, param="messages")


@dataclass
class MediaPolicy:
    """Where images may come from, how much of one is read, and how many are fetched at once."""

    allowed_local_media_path: str | None = None  # file:// urls under this directory; None: none
    allowed_media_domains: list[str] = field(default_factory=list)  # http(s) hosts allowed; []: none
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # one http(s) fetch, whole
    max_fetches: int = DEFAULT_MAX_FETCHES  # http(s) fetches in flight at once; past it: 503 at once
    _in_flight: int = field(default=0, init=False, repr=False)  # touched on the event loop only
    _tls: ssl.SSLContext | None = field(default=None, init=False, repr=False)

    async def fetch_all(self, urls: list[str]) -> list[bytes]:
        """The encoded bytes of the image at each url, in order; every url is checked before any is
        read (module docstring: what is allowed). Local files are read in a worker thread, http(s)
        images on the event loop, one after the other."""
        kinds = [self._check(url) for url in urls]
        out = []
        for url, kind in zip(urls, kinds):
            if kind == "http":
                out.append(await self._http(url))
            else:
                out.append(await asyncio.to_thread(self._data if kind == "data" else self._file, url))
        return out

    def _check(self, url: str) -> str:
        """The kind of `url` ("data", "file" or "http") if it is allowed; ProtocolError naming what is
        wrong with it otherwise (an unparsable url, a NUL in a path, a host or place not allowed)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return "data"
        if scheme not in ("file", "http", "https"):
            raise _bad_url(url, "the scheme must be data:, file: (under --allowed-local-media-path) or http(s): "
                                "(from --allowed-media-domains)")
        try:
            parsed = urllib.parse.urlsplit(url)
            host, _ = (parsed.hostname or "").lower(), parsed.port  # .port: ValueError when out of range
        except ValueError as e:
            raise _bad_url(url, f"not a valid url ({e})") from None
        if "\0" in url or "\0" in urllib.parse.unquote(parsed.path):
            raise _bad_url(url, "a NUL character (or %00) has no place in an image url")
        if scheme == "file":
            if self.allowed_local_media_path is None:
                raise _bad_url(url, "local files are not allowed (the server was started without "
                                    "--allowed-local-media-path)")
            if parsed.netloc not in ("", "localhost"):
                raise _bad_url(url, "a file: url names no host")
            return "file"
        if host not in {d.lower() for d in self.allowed_media_domains}:
            raise _bad_url(url, f"host {brief(host)} is not in --allowed-media-domains "
                                f"({', '.join(self.allowed_media_domains) or 'none allowed'})")
        return "http"

    def _too_big(self, url: str) -> ProtocolError:
        return ProtocolError(f"image {brief(url)} is larger than {self.max_image_bytes:,} bytes", param="messages")

    def _data(self, url: str) -> bytes:
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ProtocolError("a data: image url must be 'data:<type>;base64,<data>'", param="messages")
        if len(payload) > 4 * (self.max_image_bytes // 3 + 1):
            raise self._too_big(url)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("the data: image url holds invalid base64", param="messages") from None

    def _file(self, url: str) -> bytes:
        """A file under allowed_local_media_path, the path resolved (links followed) before the check
        (`_check` has refused the urls that cannot name one)."""
        root = Path(self.allowed_local_media_path).resolve()
        try:
            path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        except (OSError, RuntimeError, ValueError):  # a link loop, a name too long
            raise _bad_url(url, "no readable file there") from None
        if not path.is_relative_to(root):
            raise ProtocolError(f"image url {brief(url)} is outside --allowed-local-media-path", param="messages")
        try:
            if not path.is_file():  # a directory, a FIFO or a device is not an image file
                raise OSError("not a regular file")
            with open(path, "rb") as f:
                data = f.read(self.max_image_bytes + 1)
        except OSError:
            raise _bad_url(url, "no readable file there") from None
        if len(data) > self.max_image_bytes:
            raise self._too_big(url)
        return data

    async def _http(self, url: str) -> bytes:
        """The body at `url`, fetched within fetch_timeout_s in all, in one of max_fetches slots."""
        if self._in_flight >= self.max_fetches:
            raise _bad_url(url, f"the server is fetching {self._in_flight} images already (at most {self.max_fetches} "
                                "at once: --max-media-fetches); retry later", status=503)
        self._in_flight += 1
        try:
            async with asyncio.timeout(self.fetch_timeout_s):
                return await self._download(url)
        except TimeoutError:
            raise _bad_url(url, f"could not be fetched (timed out: not complete within {self.fetch_timeout_s:g} s, "
                                "--media-fetch-timeout)") from None
        except ProtocolError:
            raise
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as e:
            reason = "timed out" if isinstance(e, httpx.TimeoutException) else type(e).__name__
            raise _bad_url(url, f"could not be fetched ({reason})") from None
        finally:
            self._in_flight -= 1

    async def _download(self, url: str) -> bytes:
        """GET `url` from the host itself (no proxy from the environment), refusing redirects and
        bodies over max_image_bytes; the bytes as sent (no content decoding asked for or done)."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        async with httpx.AsyncClient(verify=self._tls, trust_env=False, follow_redirects=False,
                                     timeout=self.fetch_timeout_s) as client, \
                client.stream("GET", url, headers={"accept-encoding": "identity"}) as response:
            if 300 <= response.status_code < 400:
                raise _bad_url(url, f"redirects ({response.status_code}); redirects are not followed")
            if response.status_code >= 400:
                raise _bad_url(url, f"answered HTTP {response.status_code}")
            length = response.headers.get("content-length", "")
            if length.isascii() and length.isdigit() and int(length) > self.max_image_bytes:
                raise self._too_big(url)
            chunks, size = [], 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > self.max_image_bytes:
                    raise self._too_big(url)
                chunks.append(chunk)
            return b"".join(chunks)

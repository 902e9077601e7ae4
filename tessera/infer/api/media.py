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
  `--allowed-media-domains`; none by default), within `fetch_timeout_s` for the whole body, no
  redirects, and at most `max_image_bytes` read.

Every refusal is a `ProtocolError` (HTTP 400) naming the problem and what is allowed; it quotes the
client's url shortly and never anything read from the server's files.
"""

from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.infer.api.openai_protocol import ProtocolError
from tessera.infer.api.quoting import brief

DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20  # one image's encoded bytes, whichever way it comes
DEFAULT_FETCH_TIMEOUT_S = 10.0


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


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 - refuse every redirect
        raise ProtocolError(f"image url {brief(req.full_url)} redirects ({code}); redirects are not followed",
                            param="messages")


@dataclass
class MediaPolicy:
    """Where images may come from, and how much of one is read."""

    allowed_local_media_path: str | None = None  # file:// urls under this directory; None: none
    allowed_media_domains: list[str] = field(default_factory=list)  # http(s) hosts allowed; []: none
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    def fetch(self, url: str) -> bytes:
        """The encoded bytes of the image at `url` (module docstring: what is allowed)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data(url)
        if scheme == "file":
            return self._file(url)
        if scheme in ("http", "https"):
            return self._http(url)
        raise ProtocolError(f"image url {brief(url)}: the scheme must be data:, file: (under "
                            "--allowed-local-media-path) or http(s): (from --allowed-media-domains)", param="messages")

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
        if self.allowed_local_media_path is None:
            raise ProtocolError(f"image url {brief(url)}: local files are not allowed (the server was started "
                                "without --allowed-local-media-path)", param="messages")
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ProtocolError(f"image url {brief(url)}: a file: url names no host", param="messages")
        root = Path(self.allowed_local_media_path).resolve()
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(root):
            raise ProtocolError(f"image url {brief(url)} is outside --allowed-local-media-path", param="messages")
        try:
            if not path.is_file():  # a directory, a FIFO or a device is not an image file
                raise OSError("not a regular file")
            with open(path, "rb") as f:
                data = f.read(self.max_image_bytes + 1)
        except OSError:
            raise ProtocolError(f"image url {brief(url)}: no readable file there", param="messages") from None
        if len(data) > self.max_image_bytes:
            raise self._too_big(url)
        return data

    def _http(self, url: str) -> bytes:
        host = (urllib.parse.urlparse(url).hostname or "").lower()
        if host not in {d.lower() for d in self.allowed_media_domains}:
            raise ProtocolError(f"image url {brief(url)}: host {brief(host)} is not in --allowed-media-domains "
                                f"({', '.join(self.allowed_media_domains) or 'none allowed'})", param="messages")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)  # the named host itself
        try:
            with opener.open(url, timeout=self.fetch_timeout_s) as response:
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_image_bytes:
                    raise self._too_big(url)
                data = self._read(response, url, time.monotonic() + self.fetch_timeout_s)
        except ProtocolError:
            raise
        except urllib.error.HTTPError as e:
            raise ProtocolError(f"image url {brief(url)} answered HTTP {e.code}", param="messages") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = "timed out" if "timed out" in str(e) else type(e).__name__
            raise ProtocolError(f"image url {brief(url)} could not be fetched ({reason})", param="messages") from None
        return data

    def _read(self, response, url: str, deadline: float) -> bytes:
        """The body, at most max_image_bytes of it, read before `deadline` (a server that sends slowly
        is cut off, not only one that stops)."""
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                raise ProtocolError(f"image url {brief(url)} could not be fetched (timed out)", param="messages")
            chunk = response.read(min(1 << 16, self.max_image_bytes + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_image_bytes:
                raise self._too_big(url)

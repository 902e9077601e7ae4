"""Who may move KV blocks between instances: the KV peer secret of prefill/decode disaggregation.

KV transfers are authenticated apart from the API key, which every API client holds: the prefill
instance, the decode instance and the router share a secret that no API client holds. The router
signs each request to the prefill instance with it (`sign_prefill_request`, in the
PEER_SIGNATURE_HEADER header), the prefill instance answers only such requests and tags each
message it makes with it (`message_tag`, kv_transfer.py), and the decode instance takes blocks only
from a message whose tag checks out, before anything in it is read. Whoever can reach the decode
instance without the secret cannot plant blocks there, even with a genuine message in hand: the
records' checksums guard against damage only (a forger recomputes them); the tag does not verify
once a byte is changed. A replayed genuine message is harmless: its blocks are what the model
computes for its tokens.

`tessera serve --kv-role` and `tessera router` read the secret from a file (`--kv-peer-secret-file
FILE`, readable by its owner only, as an SSH key is) or from $TESSERA_KV_PEER_SECRET; never from the
command line, which every user of the machine can read (`ps`). Given neither, processes that all
listen and call on loopback (the three of the README's example on one machine) share their user's
own secret (`local_peer_secret`: made once, 32 random bytes, in a file only that user can read), so
the commands of a one-machine deployment run as they always did while no API client holds the
secret; a process listening or calling beyond loopback without one refuses to start
(`require_peer_secret`). This module imports no torch (`tessera serve --help` reads it).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from tessera.config.errors import ConfigError, TesseraError

PEER_SECRET_ENV = "TESSERA_KV_PEER_SECRET"
PEER_SIGNATURE_HEADER = "x-tessera-kv-signature"  # of a request to a prefill instance
TAG_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16  # an HMAC key nobody holding a signed message can guess
MAX_SECRET_FILE_BYTES = 4096
_MESSAGE, _PREFILL_REQUEST = b"tessera kv transfer\0", b"tessera kv prefill request\0"  # what a tag is for


class UnauthenticatedPeer(TesseraError):
    """A KV transfer message, or a request for one, not made with this instance's KV peer secret (403)."""


def _tag(key: bytes, purpose: bytes, data: bytes) -> bytes:
    return hmac.new(key, purpose + data, hashlib.sha256).digest()


def message_tag(key: bytes, body: bytes) -> bytes:
    """The TAG_BYTES tag of a KV transfer message whose bytes after the tag are `body`."""
    return _tag(key, _MESSAGE, body)


def check_message_tag(key: bytes, tag: bytes, body: bytes) -> None:
    if not hmac.compare_digest(tag, message_tag(key, body)):
        raise UnauthenticatedPeer("KV transfer message not made with this instance's KV peer secret: refused (KV "
                                  "blocks are taken only from a peer holding it)")


def sign_prefill_request(key: bytes, body: bytes) -> str:
    """The PEER_SIGNATURE_HEADER value of a request to a prefill instance with `body` (the router's)."""
    return _tag(key, _PREFILL_REQUEST, body).hex()


def check_prefill_request(key: bytes, body: bytes, signature: str | None) -> None:
    if signature is None or not hmac.compare_digest(signature.encode(), sign_prefill_request(key, body).encode()):
        raise UnauthenticatedPeer("KV prefill answers only a peer holding the KV peer secret (the router signs its "
                                  f"requests in {PEER_SIGNATURE_HEADER}): refused")


def require_peer_secret(secret: bytes | None, who: str) -> bytes:
    """`secret`, or ConfigError saying that `who` needs one, and where it comes from."""
    if not secret:
        raise ConfigError(f"{who} needs a KV peer secret, shared by the prefill instance, the decode instance and "
                          "the router and held by no API client (KV blocks are taken only from a peer holding it): "
                          f"give --kv-peer-secret-file FILE or set ${PEER_SECRET_ENV} (processes that all listen "
                          "and call on loopback share their user's own without either)")
    return secret


def local_secret_file() -> Path:
    """Where this user's own KV peer secret lives: $XDG_CONFIG_HOME (~/.config)/tessera/kv-peer-secret."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tessera" / "kv-peer-secret"


def local_peer_secret() -> bytes:
    """This user's own KV peer secret, for a deployment whose processes all listen and call on
    loopback: read from `local_secret_file()`, made there first if missing (written whole to a private
    temporary file, then linked into place, so a process starting at the same moment reads either
    nothing, and makes its own link attempt, or the whole secret)."""
    path = local_secret_file()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_hex(32).encode())
            finally:
                os.close(fd)
            try:
                os.link(temporary, path)
            except FileExistsError:  # another process made it first: theirs is the one
                pass
            finally:
                temporary.unlink()
    except OSError as e:
        raise ConfigError(f"the KV peer secret of this user could not be made at {str(path)!r} ({e.strerror or e}); "
                          f"give --kv-peer-secret-file FILE or set ${PEER_SECRET_ENV}") from None
    return _read_secret_file(str(path), "this user's KV peer secret")


def add_kv_peer_argument(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--kv-peer-secret-file", default=None, metavar="FILE",
                   help=f"file holding the KV peer secret that authenticates KV transfers, shared by {who} and "
                        f"held by no API client (at least {MIN_SECRET_BYTES} bytes, mode 600; None: "
                        f"${PEER_SECRET_ENV})")


def read_kv_peer_secret(file: str | None, api_key: str | None, on_loopback: bool = False) -> bytes | None:
    """The secret in `file`, else in $TESSERA_KV_PEER_SECRET, else, for a process that listens and
    calls on loopback only (`on_loopback`), this user's own (`local_peer_secret`); None: none of them.
    ConfigError, one line, for one shorter than MIN_SECRET_BYTES or equal to the API key, or a file
    that is not a regular file its owner alone can read."""
    if file is not None:
        source, secret = f"--kv-peer-secret-file {file!r}", _read_secret_file(file)
    elif os.environ.get(PEER_SECRET_ENV) is not None:
        source, secret = f"${PEER_SECRET_ENV}", os.fsencode(os.environ[PEER_SECRET_ENV]).strip()
    elif on_loopback:
        source, secret = str(local_secret_file()), local_peer_secret()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the KV peer secret has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are "
                          "needed (make one with: python -c 'import secrets; print(secrets.token_hex(32))')")
    if api_key is not None and secret == os.fsencode(api_key).strip():
        raise ConfigError(f"{source}: the KV peer secret must differ from --api-key, which every API client holds")
    return secret


def _read_secret_file(file: str, what: str = "--kv-peer-secret-file") -> bytes:
    invalid = f"{what} {file!r} is invalid"
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not hold the start
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise ConfigError(f"{invalid}: {getattr(e, 'strerror', None) or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(f"{invalid}: not a regular file of at most {MAX_SECRET_FILE_BYTES} bytes")
        if st.st_mode & 0o077:
            raise ConfigError(f"{invalid}: other users may read or change it (mode {stat.S_IMODE(st.st_mode):o}; "
                              "chmod 600 it)")
        return os.read(fd, MAX_SECRET_FILE_BYTES + 1).strip()
    except OSError as e:
        raise ConfigError(f"{invalid}: {e.strerror or e}") from None
    finally:
        os.close(fd)

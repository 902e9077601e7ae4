"""KV transfer messages as a peer or an attacker makes them (tests of kv_transfer.py and the KV routes)."""

from __future__ import annotations

import hashlib
import json

import torch

from tessera.infer.scheduling.kv_peer import TAG_BYTES, message_tag
from tessera.infer.scheduling.kv_transfer import MAGIC

PEER_SECRET = b"a KV peer secret of the tests"


def signed(body: bytes, key: bytes = PEER_SECRET) -> bytes:
    """A message whose bytes after the tag are `body`, made with `key` (as a peer holding it would)."""
    return MAGIC + message_tag(key, body) + body


def body_of(message: bytes) -> bytes:
    return message[len(MAGIC) + TAG_BYTES:]


def forged(message: bytes, value: float = 3.0) -> bytes:
    """`message` (genuine, from a prefill instance of a float32 cache) with every key and value of
    every block replaced by `value` and each record's checksum recomputed, as whoever holds a genuine
    message but not the peer secret can make it: the bytes before the JSON header are kept."""
    at = message.index(b'{"identity"')
    n = int.from_bytes(message[at - 4:at], "little")
    header = json.loads(message[at:at + n])
    offset, records = at + n, []
    for length in header["records"]:
        record = message[offset:offset + length]
        offset += length
        m = int.from_bytes(record[8:12], "little")
        block = json.loads(record[12:12 + m])
        payload = torch.full(((length - 12 - m) // 4,), value).numpy().tobytes()
        block["checksum"] = hashlib.blake2b(payload, digest_size=20).hexdigest()
        text = json.dumps(block).encode()
        records.append(record[:8] + len(text).to_bytes(4, "little") + text + payload)
    header["records"] = [len(r) for r in records]
    text = json.dumps(header).encode()
    return message[:at - 4] + len(text).to_bytes(4, "little") + text + b"".join(records)


def nested(depth: int) -> bytes:
    """A message body whose JSON header is `depth` arrays inside each other."""
    header = b"[" * depth + b"]" * depth
    return len(header).to_bytes(4, "little") + header

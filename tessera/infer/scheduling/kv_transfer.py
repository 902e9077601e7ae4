"""KV blocks moved between engine instances: prefill/decode disaggregation.

A prefill instance (`tessera serve --kv-role prefill`) computes a prompt and hands back the KV
blocks of its full prefix blocks as one message (`export_prefix`); a decode instance (`--kv-role
decode`) takes such a message into its host tier (`open_transfer`, then `import_prefix`), where the
request that follows finds them as a prefix hit and computes only the rest. `tessera router`
(`infer/fleet/router.py`) drives the pair over HTTP.

The message: MAGIC, a tag (kv_peer.py: an HMAC keyed with the KV peer secret the prefill
instance, the decode instance and the router share, over everything after it), a 4-byte header
length, a JSON header (model identity, block size, the prompt's token ids, each block record's
length), then the records, each `kv_tier_store.encode_block`'s (its own identity, prefix hash,
layout and checksum). The receiver checks the tag before it reads anything else (`open_transfer`):
the checksums guard against damage only. Then it recomputes the prefix hashes from the token ids
and its own block size, and keeps blocks in order while every check holds: the first block that
fails ends the import, so later blocks never attach to a wrong prefix. Nothing is deserialized as
code; the header is read by `parse_json` (nested too deeply to parse, it is a TransferError like
any malformed header).

Both ends go through the engine's `kv_exchange` (kv_exchange.py): its cache's identity and layout,
the device blocks of a hash chain, room in its host tier, the transfer counters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tessera.config.errors import TesseraError
from tessera.config.json_text import parse_json
from tessera.infer.scheduling.kv_peer import TAG_BYTES, check_message_tag, message_tag
from tessera.infer.scheduling.kv_tier_store import MAX_HEADER, decode_block, encode_block
from tessera.infer.scheduling.prefix_cache import hash_chain

MAGIC = b"TSRAKVX2"


class TransferError(TesseraError, ValueError):
    """A message that is not a well-formed transfer for this model."""


def transfer_limit(engine) -> int:
    """The largest message one sequence's blocks make: its records (data and a header each) and the
    message header with its token ids."""
    x = engine.kv_exchange
    return x.blocks_per_seq * (x.block_bytes + 2048) + x.max_model_len * 12 + 4096


def _full_hashes(block_size: int, prompt_ids: list[int]) -> list[bytes]:
    return hash_chain(prompt_ids, block_size, limit=(len(prompt_ids) - 1) // block_size)


def export_prefix(engine, prompt_ids: list[int], key: bytes) -> bytes:
    """The message carrying the blocks of `prompt_ids`' full prefix blocks that `engine`'s device
    cache holds (in the engine thread, after the prompt ran), signed with the KV peer secret `key`."""
    x = engine.kv_exchange
    identity, layout = x.identity, x.layout
    hashes = _full_hashes(x.block_size, prompt_ids)
    records = [encode_block(identity, layout, h, contents) for h, contents in zip(hashes, x.device_blocks(hashes))]
    x.metrics.transfer_out_blocks += len(records)
    header = json.dumps({"identity": identity, "block_size": x.block_size,
                         "tokens": [int(t) for t in prompt_ids], "records": [len(r) for r in records]}).encode()
    body = len(header).to_bytes(4, "little") + header + b"".join(records)
    return MAGIC + message_tag(key, body) + body


@dataclass(frozen=True)
class Transfer:
    """A message whose tag checked out (`open_transfer`): its header, and where its records start."""

    header: dict
    data: bytes
    records_at: int


def open_transfer(data: bytes, key: bytes) -> Transfer:
    """The message in `data` once its tag proves it was made with the KV peer secret `key`
    (UnauthenticatedPeer otherwise, before anything in it is read), its header parsed
    (TransferError when it is malformed). Off the engine thread: it hashes the whole message."""
    body_at = len(MAGIC) + TAG_BYTES
    if data[:len(MAGIC)] != MAGIC or len(data) < body_at + 4:
        raise TransferError("not a KV transfer message (of this version)")
    check_message_tag(key, data[len(MAGIC):body_at], data[body_at:])
    n = int.from_bytes(data[body_at:body_at + 4], "little")
    start = body_at + 4 + n
    if n > MAX_HEADER + 32 * 2**20 or start > len(data):
        raise TransferError("KV transfer header is truncated or too large")
    header = parse_json(data[body_at + 4:start], "KV transfer header", TransferError)
    records = header.get("records") if isinstance(header, dict) else None
    tokens = header.get("tokens") if isinstance(header, dict) else None
    if (not isinstance(records, list) or not all(isinstance(r, int) and r > 0 for r in records)
            or not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens)):
        raise TransferError("KV transfer header needs 'records' (positive lengths) and 'tokens' (token ids)")
    return Transfer(header, data, start)


def import_prefix(engine, transfer: Transfer) -> int:
    """Put the blocks of an authenticated message (`open_transfer`) into `engine`'s host tier (in the
    engine thread); how many were kept. TransferError when it was made for another model or block size."""
    header, offset, data = transfer.header, transfer.records_at, transfer.data
    x = engine.kv_exchange
    identity, layout = x.identity, x.layout
    if header.get("identity") != identity or header.get("block_size") != x.block_size:
        raise TransferError("the KV blocks were computed by another model, cache layout or block size")
    hashes = _full_hashes(x.block_size, header["tokens"])
    kept = 0
    for h, length in zip(hashes, header["records"]):
        contents = decode_block(data[offset:offset + length], identity, layout, h)
        offset += length
        if contents is None:
            x.metrics.transfer_rejected_blocks += 1
            break
        if not x.take_into_host(h, contents):  # every slot is in use by the plan being built
            break
        kept += 1
    x.metrics.transfer_in_blocks += kept
    return kept

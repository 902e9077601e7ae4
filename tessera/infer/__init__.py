"""Layer 7: serving. A paged-KV-cache engine with continuous batching, prefix reuse, speculative
decoding, LoRA, int8 and JSON-schema constrained output, an offline `LLM` front end and an
OpenAI-compatible HTTP server.

    from tessera.infer import LLM, SamplingParams

    llm = LLM("path/to/hf-model")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].text)
"""

from tessera.infer.config import EngineConfig, SpeculativeConfig
from tessera.infer.engine import LLMEngine
from tessera.infer.llm import LLM, Completion
from tessera.infer.sampling_params import SamplingParams
from tessera.infer.sequence import RequestOutput

__all__ = ["LLM", "Completion", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "SpeculativeConfig"]

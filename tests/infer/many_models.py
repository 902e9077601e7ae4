"""Several models behind one server in the test process (tessera/infer/fleet/model_registry.py and
multi_model_app.py over real HTTP on 127.0.0.1), and what a model's greedy answer should be."""

from __future__ import annotations

import httpx

from tessera.data.tokenizer import Tokenizer
from tessera.infer.api.server import create_app
from tessera.infer.config import EngineConfig
from tessera.infer.engine.llm_engine import LLMEngine
from tessera.infer.engine.loop import EngineLoop
from tessera.infer.fleet.model_registry import ModelRegistry
from tessera.infer.fleet.multi_model_app import create_multi_model_app
from tests.hang_guard import HANG_S
from tests.infer.running_server import AppServer
from tests.infer.tiny_models import hf_greedy


def _load(path: str, adapters: dict[str, str]) -> EngineLoop:
    config = EngineConfig(block_size=4, max_num_seqs=8, kv_cache_gib=0.001, lora_adapters=dict(adapters))
    return EngineLoop.build(lambda: LLMEngine.from_dir(path, config), 1)


class ManyModelServer(AppServer):
    """A registry of `models` behind the multi-model app, on a free 127.0.0.1 port, in a thread."""

    def __init__(self, models: dict[str, str], budget_gib: float = 1.0, keep_alive_s: float = 0.0,
                 sleep_level: int = 1, wake_timeout_s: float = HANG_S,
                 adapters: dict[str, dict[str, str]] | None = None):
        self.registry = ModelRegistry(models, _load, lambda loop, name: create_app(loop, name), budget_gib,
                                      keep_alive_s, sleep_level, wake_timeout_s=wake_timeout_s, adapters=adapters)
        self.registry.start()
        super().__init__(create_multi_model_app(self.registry), close=self.registry.close)

    def complete(self, model: str, prompt: str) -> httpx.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=HANG_S)


def expected_text(path, hf, prompt: str) -> str:
    tok = Tokenizer.from_path(path)
    return tok.decode(hf_greedy(hf, tok.encode(prompt), 6))


def answer_text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]

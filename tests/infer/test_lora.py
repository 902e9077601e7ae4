"""PEFT LoRA adapters: dynamic (several resident, mixed in one batch, loaded and unloaded while
serving) equals the same adapter merged into the weights, and equals PEFT on the HuggingFace model."""

import httpx
import pytest
import torch

from tessera.config.errors import CheckpointError, ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tiny_models import hf_greedy

peft = pytest.importorskip("peft")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TARGETS = {"llama": ["q_proj", "v_proj", "o_proj", "down_proj", "up_proj", "lm_head"],
           "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def make_adapter(model_dir, family, out_dir, seed):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8 + seed, target_modules=TARGETS[family], init_lora_weights=False)
    model = peft.get_peft_model(hf, cfg).eval()
    model.save_pretrained(out_dir)
    return model


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_dynamic_lora_equals_merged_and_peft(family, family_models, tmp_path):
    path, hf = family_models[family]
    peft_a = make_adapter(path, family, tmp_path / "a", seed=1)
    peft_b = make_adapter(path, family, tmp_path / "b", seed=2)
    prompt = "adapters change the output"
    llm = LLM(path, block_size=4, lora_adapters={"a": str(tmp_path / "a"), "b": str(tmp_path / "b")})
    ids = llm.tokenizer.encode(prompt)
    want = {"a": hf_greedy(peft_a, ids, 16), "b": hf_greedy(peft_b, ids, 16), None: hf_greedy(hf, ids, 16)}
    assert want["a"] != want[None] and want["b"] != want[None]  # the adapters matter
    # one mixed batch; the same prompt under each adapter must not share prefix-cache blocks
    order = ["a", None, "b", "a", None]
    outs = llm.generate([prompt] * len(order), GREEDY, adapter=order)
    assert [o.token_ids for o in outs] == [want[a] for a in order]
    again = llm.generate([prompt] * 3, GREEDY, adapter=["b", None, "a"])
    assert [o.token_ids for o in again] == [want["b"], want[None], want["a"]]
    merged = LLM(path, block_size=4, merge_lora=[str(tmp_path / "a")])
    assert merged.generate([prompt], GREEDY)[0].token_ids == want["a"]


def test_adapters_load_and_unload_while_serving(llama, tmp_path):
    path, _ = llama
    peft_a = make_adapter(path, "llama", tmp_path / "a", seed=3)
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, num_blocks=256))
    body = {"model": "a", "prompt": "hot swap", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with RunningServer(engine, name="tiny", allow_lora_loading=True, lora_dirs=[tmp_path]) as s:
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 404
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "a")},
                       timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert "a" in [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200
        want = hf_greedy(peft_a, engine.tokenizer.encode("hot swap"), 8)
        assert engine.tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False) == want
        assert httpx.post(s.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 404
        bad = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert not engine.lora._hooks  # unloading the last adapter removed every hook


def test_unsupported_adapters_are_refused(llama, tmp_path):
    path, _ = llama
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["embed_tokens"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "emb")
    llm = LLM(path, block_size=4, num_blocks=128)
    with pytest.raises(CheckpointError, match="embed"):
        llm.load_lora("emb", tmp_path / "emb")
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        llm.load_lora("none", tmp_path)
    with pytest.raises(ConfigError, match="not loaded"):
        llm.generate(["x"], GREEDY, adapter="nope")


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_dynamic_lora_on_quantized_weights(method, llama, tmp_path):
    """Adapters served over quantized block linears give the tokens of the same adapters over a
    full-precision model holding the dequantized weights."""
    from tessera.hf import load_pretrained

    path, _ = llama
    make_adapter(path, "llama", tmp_path / "a", seed=1)
    adapters = {"a": str(tmp_path / "a")}
    quantized = LLM(path, block_size=4, quantization=method, lora_adapters=adapters)
    reference = load_pretrained(path)
    replaced = 0
    for name, m in quantized.engine.model.named_modules():
        if name.startswith("layers.") and hasattr(m, "qweight"):
            weight = m.qweight.float() * m.scale[:, None] if method == "int8" else m.dequantized_weight(torch.float32)
            reference.get_submodule(name).weight.data.copy_(weight)
            replaced += 1
    assert replaced == 14  # 2 layers x (4 attention + 3 MLP)
    plain = LLM(reference, tokenizer=quantized.tokenizer, block_size=4, lora_adapters=adapters)
    prompt = "adapters change the output"
    got = {a: quantized.generate([prompt], GREEDY, adapter=a)[0].token_ids for a in ("a", None)}
    assert got["a"] != got[None]  # the adapter matters
    for adapter in ("a", None):
        assert got[adapter] == plain.generate([prompt], GREEDY, adapter=adapter)[0].token_ids, adapter

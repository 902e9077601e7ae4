"""Speculative decoding with the served model's own MTP module (`speculative.method="mtp"`,
tessera/infer/runner/mtp_proposer.py), through the existing verification: greedy output is the output
without speculation, sampled output keeps the target's distribution (the statistical check the
draft model's test makes), requests under a JSON schema decode one token per step, and the
acceptance counters are those of every speculation."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.config.model import ModelConfig
from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.models.transformer import Transformer
from tests.infer.test_rejection_sampling import assert_sampled_tokens_keep_the_target


def _model(seed: int = 0, mtp_depth: int = 1, **cfg) -> Transformer:
    shape = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=128,
                 mtp_depth=mtp_depth)
    shape.update(cfg)
    model = Transformer(ModelConfig(**shape), init_seed=seed)
    return model.eval()


def _teach_mtp_the_target(model: Transformer) -> None:
    """Make depth 1 a copy of the main model's last block fed with its own hidden state, so its
    drafts are often right (acceptance well above chance) while staying a different model."""
    with torch.no_grad():
        m = model.mtp["1"]
        m.block.load_state_dict(model.layers[str(model.cfg.n_layers - 1)].state_dict())
        m.norm.weight.copy_(model.norm.weight)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_the_output_without_speculation(k):
    model = _model(seed=1, init_std=0.3)
    _teach_mtp_the_target(model)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [5] * 20, list(range(30, 50))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model, block_size=4, enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(model, block_size=4, enable_prefix_caching=False,
              speculative=SpeculativeConfig(method="mtp", num_tokens=k))
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    m = llm.engine.metrics
    assert m.spec_proposed > 0 and m.spec_accepted > 0  # the module drafted, and some drafts held
    assert m.steps < 4 * 24  # fewer target steps than one per token of every request


def test_greedy_output_with_the_prefix_cache_and_an_moe_mla_model():
    """A prompt that hits cached blocks drafts nothing for them (its hidden states were never
    computed) and still decodes exactly; DeepSeek-style MLA + MoE blocks draft too."""
    from tessera.config.model import MLAConfig, MoEConfig

    model = _model(seed=2, family="deepseek_v3", n_kv_heads=4, init_std=0.2,
                   mla=MLAConfig(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                 v_head_dim=8),
                   moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=16, score_func="sigmoid", first_k_dense=1))
    assert_a_cached_prefix_drafts_nothing_and_decodes_exactly(model, SpeculativeConfig(method="mtp", num_tokens=2))


def assert_a_cached_prefix_drafts_nothing_and_decodes_exactly(model, speculative: SpeculativeConfig) -> None:
    """Two greedy prompts sharing 16 tokens (4 cached blocks of 4): the second, which starts past
    the cached prefix, drafts nothing, and both decode as without speculation. (A proposer fed
    with the target's hidden states has none for cached blocks; the MTP and EAGLE tests share this.)"""
    prompts = [list(range(1, 17)) + [3, 4], list(range(1, 17)) + [7]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(model, block_size=4).generate(prompts, params)
    llm = LLM(model, block_size=4, speculative=speculative)
    first = llm.generate(prompts[:1], params)
    drafted = llm.engine.metrics.spec_proposed
    second = llm.generate(prompts[1:], params)  # starts past the cached prefix
    assert [o.token_ids for o in first + second] == [o.token_ids for o in plain]
    assert drafted > 0 and llm.engine.metrics.spec_proposed == drafted  # none for the cached one


def test_requests_with_a_json_schema_decode_one_token_per_step(tmp_path):
    from tessera.data.tokenizer import load_tokenizer
    from tests.infer.tiny_models import VOCAB, save_tokenizer

    save_tokenizer(tmp_path)
    llm = LLM(_model(seed=3, vocab_size=VOCAB), block_size=4, tokenizer=load_tokenizer(tmp_path),
              speculative=SpeculativeConfig(method="mtp", num_tokens=3))
    assert_schema_requests_never_draft(llm)


def assert_schema_requests_never_draft(llm: LLM) -> None:
    """Sampled requests under a JSON schema give valid JSON with no speculative step; a free
    request afterwards drafts (the proposer works, the schema was what kept it off)."""
    from tests.infer.test_structured_output import PERSON, SEEDS, as_format

    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=s, response_format=as_format(PERSON))
              for s in SEEDS]
    for out in llm.generate(["Answer:"] * len(SEEDS), params):
        jsonschema.validate(json.loads(out.text), PERSON)
    assert llm.engine.metrics.spec_steps == 0
    llm.generate("ab ab ab", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert llm.engine.metrics.spec_steps > 0


def test_a_model_without_mtp_modules_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"speculative.method='mtp' needs a model with multi-token-prediction"):
        LLM(_model(mtp_depth=0), speculative=SpeculativeConfig(method="mtp"))
    with pytest.raises(ConfigError, match="decode_batch_sizes"):
        LLM(_model(), decode_batch_sizes=[1, 2], speculative=SpeculativeConfig(method="mtp"))


@pytest.mark.slow
def test_sampling_with_mtp_drafts_keeps_the_target_distribution():
    """Second and third tokens (produced by verification) of 6000 seeded requests against the
    exact marginals computed from the target model, as the draft model's test checks."""
    model = _model(seed=4, vocab_size=8, n_layers=1, init_std=0.5)
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        two = torch.tensor([prompt + [a] for a in range(8)])
        p2 = torch.softmax(model(two).logits[:, -1], -1)
        three = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        p3 = torch.softmax(model(three).logits[:, -1], -1).view(8, 8, 8)
    want2 = p1 @ p2
    want3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    llm = LLM(model, block_size=4, max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_caching=False,
              speculative=SpeculativeConfig(method="mtp", num_tokens=2))
    assert_sampled_tokens_keep_the_target(llm, prompt, want2, want3)


def test_tessera_serve_refuses_mtp_for_a_model_without_it(llama, capsys):
    from tessera.cli import main

    status = main(["serve", str(llama[0]), "--port", "0", "--device", "cpu", "--speculative", "mtp"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "tessera serve: error: " in err and "speculative.method='mtp' needs a model with multi-token" in err


def test_a_run_trained_with_mtp_serves_its_drafts_over_http(tmp_path):
    """`tessera train` with model.mtp_depth=1 writes a run whose checkpoint holds the MTP module;
    served with speculation "mtp" it answers like the run without speculation and /metrics counts
    the drafts."""
    import httpx

    from tessera.config.schema import load_config
    from tessera.infer import EngineConfig, LLMEngine
    from tessera.train.trainer import Trainer
    from tests.hang_guard import HANG_S
    from tests.infer.running_server import RunningServer
    from tests.train.runs import TINY_DENSE, build_small_dataset, shrink

    (tmp_path / "data").mkdir()
    data = build_small_dataset(tmp_path / "data")
    run = tmp_path / "run"
    Trainer(load_config(TINY_DENSE, shrink(data, run, 4, **{"model.mtp_depth": 1, "checkpoint.interval": 4}))).train()
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 16, "temperature": 0.0}
    plain = LLMEngine.from_dir(run, EngineConfig(block_size=4))
    with RunningServer(plain, name="tiny") as s:
        want = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S).json()["choices"][0]["text"]
    engine = LLMEngine.from_dir(run, EngineConfig(block_size=4, speculative={"method": "mtp", "num_tokens": 2}))
    assert engine.model.mtp is not None
    with RunningServer(engine, name="tiny") as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        text = httpx.get(s.url + "/metrics").text
    proposed = [ln for ln in text.splitlines() if ln.startswith("tessera_spec_proposed_tokens_total")]
    assert proposed and float(proposed[0].split()[-1]) > 0
    assert "# TYPE tessera_spec_acceptance_rate" in text

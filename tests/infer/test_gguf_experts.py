"""Routed experts a GGUF file stores in block types, kept as the file's blocks (`GgufExperts`,
tessera/models/moe/gguf_experts.py) instead of dequantized at load: tiny GLM-4.5 (shared experts, a
dense first layer, sigmoid routing with a bias; gate Q4_K, up Q8_0, down Q6_K), Llama 4 (one expert
per token, a shared expert; gate Q4_0, up Q5_0, down Q4_1) and Qwen3.5-MoE (DeltaNet layers, a gated
shared expert, the packed experts' parts; gate Q8_0, up Q4_0, down Q5_1) files. The experts hold exactly the file's
expert bytes; by themselves (the reference) they give the dequantized load's logits; through the CPU
block kernel each expert's product stays within the kernel's int16 rounding bound of the product by
its dequantized matrix, is the same bits on one thread and two, and runs only for the experts the
router picked; served through the engine, the greedy tokens equal the dequantized load's for 32
tokens. Tensor-parallel serving dequantizes them, since expert tensor parallelism cuts float experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.checkpoint.gguf import GGUFFile, load_gguf
from tessera.infer import LLM, SamplingParams
from tessera.infer.cpu import attention as cpu_attention
from tessera.infer.cpu.gguf_matmul import MAX_ROWS, expert_product, use_block_kernels
from tessera.infer.runner import gguf_shards
from tessera.models.moe.experts import GroupedExperts
from tessera.models.moe.gguf_experts import PROJECTIONS, ExpertBlocks, GgufExperts
from tests.checkpoint.gguf_more_family_files import tiny_model, write_gguf
from tests.infer.test_gguf_matmul import int16_rounded

KINDS = {"glm4moe": {"gate": "Q4_K", "up": "Q8_0", "down": "Q6_K"},
         "llama4": {"gate": "Q4_0", "up": "Q5_0", "down": "Q4_1"},
         "qwen35moe": {"gate": "Q8_0", "up": "Q4_0", "down": "Q5_1"}}
MOE_LAYERS = {"glm4moe": 2, "llama4": 2, "qwen35moe": 4}
PART = {"w1": "gate", "w2": "down", "w3": "up"}
PROMPTS = ["def main():\n    return", "The quick brown fox"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-experts")
    # Qwen3.5's DeltaNet heads keep the model narrow: 64 wide, experts of 64 (blocks of 32 values)
    return {arch: write_gguf(tiny_model(arch, seed=1, wide=arch == "qwen35moe",
                                        experts_width=64 if arch == "qwen35moe" else 256),
                             root / f"{arch}.gguf", arch, experts=kinds)
            for arch, kinds in KINDS.items()}


@pytest.fixture
def built(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"


def _experts(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if name.endswith("moe.experts")}


@pytest.mark.parametrize("arch", list(KINDS))
def test_kept_experts_hold_the_files_expert_bytes(arch, files):
    model = load_gguf(files[arch], keep_quantized=True)
    experts = _experts(model)
    assert len(experts) == MOE_LAYERS[arch] and all(type(m) is GgufExperts for m in experts.values())
    stored = {s.entry.name: s for s in GGUFFile.open(files[arch]).stored() if s.entry.name.endswith("_exps.weight")}
    held = 0
    for name, m in experts.items():
        layer = name.split(".")[1]
        for part in PROJECTIONS:
            blocks: ExpertBlocks = getattr(m, part)
            entry = stored[f"blk.{layer}.ffn_{PART[part]}_exps.weight"]
            assert blocks.kind == entry.kind == KINDS[arch][PART[part]]
            assert blocks.blocks.dtype == torch.uint8 and blocks.blocks.nbytes == entry.nbytes
            held += blocks.blocks.nbytes
        assert not list(m.parameters())  # no float copy of any expert
    assert held == sum(s.nbytes for s in stored.values())


@pytest.mark.parametrize("arch", list(KINDS))
def test_the_reference_gives_the_dequantized_loads_logits(arch, files):
    dense, kept = load_gguf(files[arch]), load_gguf(files[arch], keep_quantized=True)
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = dense(ids).logits
        torch.testing.assert_close(kept(ids).logits, want, rtol=1e-6, atol=1e-6)
    assert isinstance(_experts(dense)["layers.1.moe.experts"], GroupedExperts)
    # The kernel installed, autograd on (a trainer's forward): the reference still.
    assert use_block_kernels(kept) > 0
    torch.testing.assert_close(kept(ids).logits.detach(), want, rtol=1e-6, atol=1e-6)


def test_each_experts_product_is_within_the_kernels_rounding_bound(files, built):
    experts = _experts(load_gguf(files["glm4moe"], keep_quantized=True))["layers.1.moe.experts"]
    assert use_block_kernels(torch.nn.Sequential(experts)) == 3
    gen = torch.Generator().manual_seed(3)
    for part in PROJECTIONS:
        blocks: ExpertBlocks = getattr(experts, part)
        for e in range(blocks.num_experts):
            x, w = torch.randn(5, blocks.in_features, generator=gen), blocks.weight(e, torch.float32)
            with torch.no_grad():
                y = blocks(e, x)
            _, amax = int16_rounded(x)
            slack = 2e-6 * (x.abs() @ w.abs().T) + 1e-6
            error, bound = (y - F.linear(x, w)).abs(), (amax / 65534) @ w.abs().T + slack
            assert (error <= bound).all() and error.max() > 0, (part, e, (error / bound).max())
            many = torch.randn(MAX_ROWS + 1, blocks.in_features, generator=gen)  # a long chunk: the reference's bits
            with torch.no_grad():
                assert torch.equal(expert_product(blocks, e, many), F.linear(many, w))


def test_the_kernels_bits_do_not_depend_on_threads(files, built):
    experts = _experts(load_gguf(files["glm4moe"], keep_quantized=True))["layers.2.moe.experts"]
    use_block_kernels(torch.nn.Sequential(experts))
    x, counts = torch.randn(9, experts.dim, generator=torch.Generator().manual_seed(4)), torch.tensor([3, 0, 5, 1])
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = experts(x, counts)
            torch.set_num_threads(2)
            two = experts(x, counts)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and one[3:3].numel() == 0
    assert not torch.equal(one, experts.dequantized(torch.float32, use_grouped_mm=False)(x, counts))  # the kernel's


def test_only_the_routed_experts_run(files, built):
    model = load_gguf(files["glm4moe"], keep_quantized=True)
    use_block_kernels(model)
    computed: dict[str, list[int]] = {}
    for name, m in _experts(model).items():
        m.w1.register_forward_pre_hook(lambda mod, args, name=name: computed.setdefault(name, []).append(args[0]))
    routed: dict[str, set[int]] = {}
    for name, m in model.named_modules():
        if name.endswith(".moe.router"):
            m.register_forward_hook(lambda mod, args, out, name=name: routed.setdefault(
                name.removesuffix("router") + "experts", set()).update(out.indices_Tk.flatten().tolist()))
    with torch.no_grad():
        model(torch.tensor([[17]]))  # one token: top-2 of 4 experts in each MoE layer
    assert computed.keys() == routed.keys() and len(computed) == 2
    for name, es in computed.items():
        assert len(es) == 2 and set(es) == routed[name]


@pytest.mark.parametrize("arch", list(KINDS))
def test_served_greedy_tokens_equal_the_dequantized_loads(arch, files, built):
    options = dict(max_num_seqs=2, max_model_len=64, block_size=4)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    dense = LLM(files[arch], gguf_keep_quantized=False, **options)
    kept = LLM(files[arch], gguf_keep_quantized=True, **options)
    experts = list(_experts(kept.engine.model).values())
    assert experts and all(type(m) is GgufExperts and m.w1.fused is expert_product for m in experts)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the kept model's logits, kernel and all, against the dequantized model's
        want, got = dense.engine.model(ids).logits, kept.engine.model(ids).logits
    error = (got - want).abs().max()
    assert 0 < error <= 1e-3 * want.abs().max(), error
    want_tokens = [c.token_ids for c in dense.generate(PROMPTS, params)]
    assert [c.token_ids for c in kept.generate(PROMPTS, params)] == want_tokens
    assert all(len(t) == 32 for t in want_tokens)
    dense.engine.close()
    kept.engine.close()


def test_tensor_parallel_serving_dequantizes_the_kept_experts(files):
    dense, kept = load_gguf(files["llama4"]), load_gguf(files["llama4"], keep_quantized=True)
    assert all(type(m) is GgufExperts for m in _experts(kept).values())
    gguf_shards.stand_in(kept)
    for name, m in _experts(kept).items():
        assert type(m) is GroupedExperts
        for part in PROJECTIONS:
            assert torch.equal(getattr(m, part), getattr(_experts(dense)[name], part))

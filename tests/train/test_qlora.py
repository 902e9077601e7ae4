"""QLoRA (train.lora.quantize_base: int8 / int4, tessera.models.quantized's round-to-nearest): the base is held
quantized, each weight within the quantizer's bound (half a step) of the source's, and a run trains exactly as
LoRA over the dequantized base does (losses and adapters, fp32 1e-5); it resumes bit for bit, exports merged
with its logits, trains in bf16, and holds the base in at most the format's bytes per weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.checkpoint.convert import convert
from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.peft import merged_state
from tessera.checkpoint.hf.writer import save_pretrained
from tessera.config.schema import load_config
from tessera.models import Transformer
from tessera.models.int8 import Int8Linear
from tessera.models.lora import adapter_parameter_names
from tessera.models.quantized import Int4Linear, quantize_model
from tessera.train.trainer import Trainer
from tests.train.runs import TINY_DENSE, shrink

# in_features of 64 and 256: int4 groups of the whole row and of 128. AdamW eps 1e-3 as in the layout tests
# (tests/parallel/trainer_runs.py): int8 scales the product, not the weight, so the two runs' gradients differ
# by rounding, which the default eps would turn into lr-sized steps of near-zero gradients.
LORA = {"train.lora.rank": 4, "train.lora.alpha": 8, "optim.lr": 1e-2, "optim.eps": 1e-3, "model.preset": "null",
        "model.ffn_dim": 256}
LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


@pytest.fixture(scope="module")
def base(small_dataset, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base")
    cfg = load_config(TINY_DENSE, shrink(small_dataset, root / "unused", 1, **{"model.ffn_dim": 256})).model
    save_pretrained(Transformer(cfg, init_seed=5), root / "hf", tokenizer="default")
    return root / "hf"


def dequantized_base(base: Path, method: str, out: Path) -> Path:
    """The base as the quantizer rounds it, in full precision, as a HuggingFace directory."""
    model = load_pretrained(base)
    quantize_model(model, method)
    with torch.device("meta"):
        plain = Transformer(model.cfg, init_seed=None)
    plain.to_empty(device="cpu")
    plain.load_state_dict(merged_state(model))
    save_pretrained(plain, out, tokenizer="default")
    return out


def run(dataset: str, run_dir: Path, source: Path, steps: int = 3, **extra) -> Trainer:
    trainer = Trainer(load_config(TINY_DENSE, shrink(dataset, run_dir, steps, **{
        "train.init_from": str(source), **LORA, **extra})))
    trainer.result = trainer.train()
    return trainer


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_qlora_trains_as_lora_over_the_dequantized_base(small_dataset, base, tmp_path, method):
    qlora = run(small_dataset, tmp_path / "q", base, **{"train.lora.quantize_base": method})
    lora = run(small_dataset, tmp_path / "l", dequantized_base(base, method, tmp_path / "deq"))
    for got, want in zip(qlora.result.records, lora.result.records, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    theirs = dict(lora.model.named_parameters())
    for name in adapter_parameter_names(qlora.model):
        torch.testing.assert_close(qlora.model.get_parameter(name), theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    quantized = {n: m for n, m in qlora.model.named_modules() if isinstance(m, LAYERS[method])}
    assert len(quantized) == 7 * qlora.cfg.model.n_layers  # every block linear layer, adapted or not
    source = load_pretrained(base).state_dict()
    for name, module in quantized.items():  # each weight within half a quantization step of the source's
        W, deq = source[f"{name}.weight"], merged_state_weight(module)
        step = module.scale[:, None] if method == "int8" else module.scale.repeat_interleave(
            W.shape[1] // module.scale.shape[1], dim=1)
        assert bool(((W - deq).abs() <= step / 2 + 1e-7).all()), name
        trained = {n for n, p in module.named_parameters() if p.requires_grad}
        assert trained == {"lora_A.weight", "lora_B.weight"}, name


def merged_state_weight(module) -> torch.Tensor:
    from tessera.checkpoint.hf.peft import base_weight

    return base_weight(module, "weight")


def test_the_quantized_base_takes_its_format_bytes(small_dataset, base, tmp_path):
    """int4: half a byte per block weight and an fp32 scale per group; int8: a byte and a scale per row."""
    for method, most in (("int4", 0.5 + 4 / 64), ("int8", 1 + 4 / 64)):
        trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / method, 1, **{
            "train.init_from": str(base), **LORA, "train.lora.quantize_base": method})))
        layers = [m for m in trainer.model.modules() if isinstance(m, LAYERS[method])]
        weights = sum(m.in_features * m.out_features for m in layers)
        stored = sum(m.qweight.nbytes + m.scale.nbytes for m in layers)
        assert stored / weights <= most, (method, stored / weights)


def test_a_qlora_run_resumes_bit_for_bit_and_exports_merged(small_dataset, base, tmp_path):
    from transformers import AutoModelForCausalLM

    q = {"train.lora.quantize_base": "int4", "checkpoint.interval": 2}
    straight = run(small_dataset, tmp_path / "a", base, 4, **q)
    run(small_dataset, tmp_path / "b", base, 2, **q)
    resumed = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "b", 4, **{
        "train.init_from": str(base), **LORA, **q})), resume=True)
    got = resumed.train().records
    assert [r["loss"] for r in got] == [r["loss"] for r in straight.result.records[2:]]
    for (name, t), u in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(t, u), name
    convert(tmp_path / "a", tmp_path / "merged", lora="merge")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        want = straight.model.eval()(ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


def test_qlora_trains_in_bf16_with_fp32_adapters(small_dataset, base, tmp_path):
    fp32 = run(small_dataset, tmp_path / "fp32", base, 2, **{"train.lora.quantize_base": "int8"})
    bf16 = run(small_dataset, tmp_path / "bf16", base, 2, **{"train.lora.quantize_base": "int8",
                                                             "train.dtype": "bf16"})
    assert {bf16.model.get_parameter(n).dtype for n in adapter_parameter_names(bf16.model)} == {torch.float32}
    for got, want in zip(bf16.result.records, fp32.result.records, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)


def test_the_quantized_base_reads_each_source_alike(small_dataset, tmp_path):
    """From a Tessera run, from its HuggingFace export and (without train.init_from) from the seed, the
    base is the source's weights rounded, read one tensor at a time."""
    plain = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "plain", 1, **{"model.ffn_dim": 256})))
    plain.train()
    convert(tmp_path / "plain", tmp_path / "hf")
    q = {**LORA, "train.lora.quantize_base": "int4"}
    states = [Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / name, 1, **{
        "train.init_from": str(tmp_path / source), **q}))).model.state_dict() for name, source in (
        ("a", "plain"), ("b", "hf"))]
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key
    seeded = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "c", 1, **q))).model
    reference = Transformer(seeded.cfg, init_seed=0)
    quantize_model(reference, "int4")
    for name, module in reference.named_modules():
        if isinstance(module, Int4Linear):
            assert torch.equal(seeded.get_submodule(name).qweight, module.qweight), name
            assert torch.equal(seeded.get_submodule(name).scale, module.scale), name
    assert torch.equal(seeded.tok_embeddings.weight, reference.tok_embeddings.weight)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_quantized_layer_saves_no_dequantized_weight_for_backward(method):
    """The input's gradient through a quantized layer equals autograd's through its dequantized weight, and
    backward makes that weight again from the codes: autograd saves nothing of the weight's size."""
    from tessera.checkpoint.hf.peft import base_weight
    from tessera.models.quantized import LAYERS as QUANTIZED

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    layer = QUANTIZED[method][0].from_linear(linear).requires_grad_(False)
    x = torch.randn(3, 5, 256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = layer(x)
    assert (96, 256) not in saved and (256, 96) not in saved
    weights = torch.randn(y.shape)
    (y * weights).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    reference = torch.nn.functional.linear(x2, base_weight(layer, "weight"), layer.bias)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    (reference * weights).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)

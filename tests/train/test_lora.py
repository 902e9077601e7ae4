"""LoRA training (train.lora, tessera.models.lora): adapters compute what PEFT's do on the same weights,
forward and gradients (PEFT is the oracle, fp32 1e-5), for dense, biased, MoE and MLA families; a run
trains the adapters alone over a base read from a HuggingFace directory, which stays bit-identical and
holds no optimizer state, in pretraining and SFT; what cannot be adapted is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.checkpoint.hf.load import load_pretrained
from tessera.checkpoint.hf.writer import save_pretrained
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.config.training.lora import LoRAConfig, lora_targets
from tessera.models import Transformer
from tessera.models.lora import adapter_parameter_names, add_adapters
from tessera.train.trainer import Trainer
from tests.infer.tiny_models import write_model
from tests.train.runs import TINY_DENSE, TINY_MOE, moe_shrink, shrink

peft = pytest.importorskip("peft")


def peft_pair(tmp_path, family: str, lora: LoRAConfig, seed: int = 1):
    """A random HuggingFace model of `family` under PEFT and the same model in Tessera with the same
    adapters, A and B both random (a fresh B is zero, which would hide half the product)."""
    hf = write_model(tmp_path / family, family)
    model = load_pretrained(tmp_path / family)
    targets = lora_targets(model.cfg, lora)
    add_adapters(model, list(targets), lora.rank, lora.scaling, seed=0)
    short = sorted({h.rsplit(".", 1)[1] for h in targets.values()})
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=short, use_rslora=lora.rslora,
                             init_lora_weights=False)
    oracle = peft.get_peft_model(hf, config)
    ours, theirs = dict(model.named_modules()), dict(oracle.named_modules())
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    with torch.no_grad():
        for name, hf_name in targets.items():
            for factor in ("lora_A", "lora_B"):
                a = ours[name].get_submodule(factor).weight
                b = theirs[f"base_model.model.{hf_name}"].get_submodule(factor)["default"].weight
                value = 0.1 * torch.randn(a.shape, generator=gen)
                a.copy_(value)
                b.copy_(value)
                pairs.append((f"{name}.{factor}", a, b))
    return model, oracle, pairs


@pytest.mark.parametrize("family,lora", [
    ("llama", LoRAConfig(rank=4, alpha=6.0)),
    ("qwen2", LoRAConfig(rank=3, alpha=5.0, rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])),
    ("mixtral", LoRAConfig(rank=2, alpha=4.0)),  # attention only: the experts take no adapter
    ("deepseek_v3", LoRAConfig(rank=4, alpha=8.0)),  # MLA's projections
])
def test_adapters_forward_and_gradients_equal_peft(tmp_path, family, lora):
    model, oracle, pairs = peft_pair(tmp_path, family, lora)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    ours, theirs = model(ids).logits, oracle(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3))
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    for name, a, b in pairs:
        scale = b.grad.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(a.grad / scale, b.grad / scale, rtol=1e-5, atol=1e-5, msg=name)
    trained = {f"{n}.weight" for n, _, _ in pairs}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trained == set(adapter_parameter_names(model))


def test_fresh_adapters_leave_the_model_as_it_was_and_draw_by_name(tmp_path):
    write_model(tmp_path / "hf", "llama")
    base, model = load_pretrained(tmp_path / "hf"), load_pretrained(tmp_path / "hf")
    targets = list(lora_targets(model.cfg, LoRAConfig(rank=4)))
    add_adapters(model, targets, 4, 1.0, seed=7)
    ids = torch.randint(3, 128, (1, 10))
    torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)
    again = load_pretrained(tmp_path / "hf")
    add_adapters(again, targets, 4, 1.0, seed=7)
    A = model.get_submodule("layers.1.attention.wv.lora_A").weight
    assert torch.equal(A, again.get_submodule("layers.1.attention.wv.lora_A").weight)
    assert 0 < float(A.detach().abs().max()) <= 1 / A.shape[1] ** 0.5  # PEFT's kaiming-uniform bound, 1/sqrt(in)
    assert not model.get_submodule("layers.1.attention.wv.lora_B").weight.any()


def _hf_start(tmp_path, **fields):
    """A random tiny model of the bundled tokenizer's vocabulary, as a HuggingFace directory."""
    cfg = load_config(TINY_DENSE, shrink("unused", tmp_path / "unused", 1, **fields)).model
    save_pretrained(Transformer(cfg, init_seed=5), tmp_path / "hf")
    return tmp_path / "hf"


def _sft_dataset(directory) -> str:
    from tessera.data import default_tokenizer, preprocess_sft

    records = [{"prompt": f"What is {i} plus {i + 2}?", "response": f"{2 * i + 2}."} for i in range(60)]
    (directory / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    preprocess_sft([directory / "chat.jsonl"], directory / "sft", default_tokenizer(), show_progress=False)
    return str(directory / "sft")


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_a_run_trains_the_adapters_alone_over_a_frozen_base(small_dataset, tmp_path, kind):
    source = _hf_start(tmp_path)
    data = small_dataset if kind == "pretrain" else _sft_dataset(tmp_path)
    cfg = load_config(TINY_DENSE, shrink(data, tmp_path / "run", 4, **{
        "data.kind": kind, "train.init_from": str(source), "model.preset": "null", "train.lora.rank": 4,
        "train.lora.alpha": 8, "train.lora.target_modules": "[q_proj, v_proj, gate_proj]", "optim.lr": 1e-2}))
    trainer = Trainer(cfg)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    records = trainer.train().records
    base = load_pretrained(source).state_dict()
    adapters = set(adapter_parameter_names(trainer.model))
    assert len(adapters) == 2 * 3 * cfg.model.n_layers
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    for name, p in trainer.model.named_parameters():
        if name in adapters:
            assert p.requires_grad and id(p) in optimized and p in trainer.optimizer.state, name
            assert not torch.equal(p, start[name]), name  # trained (B leaves zero at the first step)
        else:
            assert torch.equal(p, base[name]), name  # the source's weights, bit for bit
            assert p.grad is None and not p.requires_grad and id(p) not in optimized, name
    assert len(trainer.optimizer.state) == len(adapters)
    assert all(r["loss"] > 0 for r in records) and records[-1]["loss"] < records[0]["loss"]


def test_modules_to_save_train_whole_beside_the_adapters(small_dataset, tmp_path):
    cfg = load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "run", 2, **{
        "train.lora.rank": 2, "train.lora.modules_to_save": "[lm_head]"}))
    trainer = Trainer(cfg)
    trainer.train()
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained == set(adapter_parameter_names(trainer.model)) | {"output.weight"}
    assert len(trainer.optimizer.state) == len(trained)


@pytest.mark.parametrize("setting,message", [
    ({"train.lora.target_modules": "[q_proj, qkv]"},
     r"train.lora.target_modules=\['q_proj', 'qkv'\] is invalid: 'qkv' is no linear layer of this llama model; "
     r"allowed: q_proj, k_proj, v_proj, o_proj, gate_proj, down_proj, up_proj or all-linear"),
    ({"train.lora.rank": 0}, r"train.lora.rank=0 is invalid: must be in 1..4096"),
    ({"train.lora.rank": 4, "train.lora.dropout": 1.0}, r"train.lora.dropout=1.0 is invalid: must be in \[0, 1\)"),
    ({"train.lora.rank": 4, "train.lora.quantize_base": "fp8"},
     r"train.lora.quantize_base='fp8' is invalid: one of int8, int4, or null"),
    ({"train.lora.rank": 4, "train.lora.modules_to_save": "[norm]"},
     r"train.lora.modules_to_save=\['norm'\] is invalid: 'norm' is not a module .* allowed: embed_tokens, lm_head"),
    ({"train.lora.rank": 4, "model.tie_embeddings": True, "train.lora.modules_to_save": "[lm_head]"},
     r"lm_head is the embedding here \(model.tie_embeddings=true\): name embed_tokens"),
    ({"train.lora.quantize_base": "int4"}, r"train.lora.quantize_base='int4' is invalid: needs train.lora.rank"),
    ({"train.lora.rank": 4, "train.lora.quantize_base": "int8", "parallel.tp": 2},
     r"parallel.tp=2 is invalid: 1 with train.lora.quantize_base='int8' \(a quantized base trains in one process\)"),
    ({"train.lora.rank": 4, "train.eagle.target": "somewhere"}, r"train.eagle.target='somewhere' is invalid: null "
     r"with train.lora"),
    ({"train.lora.rank": 4, "train.objective": "dpo", "data.kind": "preference"},
     r"train.objective='dpo' is invalid: lm with train.lora"),
])
def test_what_cannot_be_adapted_is_refused_by_name(tmp_path, setting, message):
    if "train.lora.target_modules" in setting:
        setting = {"train.lora.rank": 4, **setting}
    with pytest.raises(ConfigError, match=message):
        load_config(TINY_DENSE, shrink("unused", tmp_path, 1, **setting))


def test_a_rank_larger_than_a_layer_is_refused_naming_it(small_dataset, tmp_path):
    cfg = load_config(TINY_DENSE, shrink(small_dataset, tmp_path, 1, **{"train.lora.rank": 100}))
    with pytest.raises(ConfigError, match=r"train.lora.rank=100 is invalid: layers.0.attention.wk is 32x64, so the "
                                          r"rank must be at most 32"):
        Trainer(cfg)


def test_routed_experts_are_refused_and_attention_is_adapted(small_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"'gate_proj' names the routed experts of this qwen3_moe model, which take "
                                          r"no adapter .* allowed: q_proj, k_proj, v_proj, o_proj or all-linear"):
        load_config(TINY_MOE, moe_shrink("unused", tmp_path, 1, **{
            "model.family": "qwen3_moe", "model.qk_norm": True, "train.lora.rank": 2,
            "train.lora.target_modules": "[q_proj, gate_proj]"}))
    cfg = load_config(TINY_MOE, moe_shrink(small_dataset, tmp_path / "run", 2, **{"train.lora.rank": 2}))
    trainer = Trainer(cfg)
    trainer.train()
    adapted = {n.rsplit(".", 2)[0] for n in adapter_parameter_names(trainer.model)}
    assert adapted == {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}


def test_a_stopped_and_resumed_run_continues_as_the_straight_one(small_dataset, tmp_path):
    lora = {"train.lora.rank": 4, "train.lora.target_modules": "[all-linear]", "checkpoint.interval": 2}
    straight = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "a", 4, **lora)))
    want = straight.train().records
    Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "b", 2, **lora))).train()
    resumed = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "b", 4, **lora)), resume=True)
    got = resumed.train().records
    assert [r["step"] for r in got] == [3, 4]
    assert [r["loss"] for r in got] == [r["loss"] for r in want[2:]]
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_init_from_a_tessera_run_fills_the_base_and_leaves_the_adapters_fresh(small_dataset, tmp_path):
    plain = Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "plain", 1)))
    plain.train()
    cfg = load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "run", 1, **{
        "train.init_from": str(tmp_path / "plain"), "train.lora.rank": 2}))
    trainer = Trainer(cfg)
    base = dict(plain.model.named_parameters())
    for name, p in trainer.model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name
        else:
            assert name.endswith(("lora_A.weight", "lora_B.weight")), name
            assert bool(p.any()) == name.endswith("lora_A.weight"), name  # A drawn, B zero

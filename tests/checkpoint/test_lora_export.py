"""A LoRA run's checkpoint exported (`tessera convert RUN OUT --lora-adapter` / `--merge-lora`): PEFT loads the
adapter directory over the HuggingFace base with the trained model's logits (fp32 1e-4), `modules_to_save`
included; its files are PEFT's names and layout, which vLLM reads; `tessera serve BASE --lora NAME=DIR`
serves it with PEFT's greedy tokens; the merged directory gives the same logits in transformers; and a
LoRA run converts only so, refused by name otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tessera.checkpoint.convert import convert
from tessera.checkpoint.hf.writer import save_pretrained
from tessera.cli import build_parser, main
from tessera.config.errors import ConfigError
from tessera.config.schema import load_config
from tessera.infer import EngineConfig, LLMEngine
from tessera.models import Transformer
from tessera.train.trainer import Trainer
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tiny_models import hf_greedy
from tests.train.runs import TINY_DENSE, shrink

peft = pytest.importorskip("peft")
LORA = {"train.lora.rank": 4, "train.lora.alpha": 8, "optim.lr": 1e-2, "model.preset": "null"}


@pytest.fixture(scope="module")
def base(small_dataset, tmp_path_factory) -> Path:
    """A random tiny model on the bundled tokenizer, as a HuggingFace directory (tokenizer included)."""
    root = tmp_path_factory.mktemp("base")
    cfg = load_config(TINY_DENSE, shrink(small_dataset, root / "unused", 1)).model
    save_pretrained(Transformer(cfg, init_seed=5), root / "hf", tokenizer="default")
    return root / "hf"


def lora_run(small_dataset, base: Path, run: Path, **extra) -> Trainer:
    trainer = Trainer(load_config(TINY_DENSE, shrink(small_dataset, run, 3, **{
        "train.init_from": str(base), **LORA, **extra})))
    trainer.train()
    return trainer.model.eval()


@pytest.fixture(scope="module")
def trained(small_dataset, base, tmp_path_factory):
    """A 3-step LoRA run over `base` on every linear layer, and its adapter directory."""
    root = tmp_path_factory.mktemp("lora")
    model = lora_run(small_dataset, base, root / "run")
    assert main(["convert", str(root / "run"), str(root / "adapter"), "--lora-adapter"]) == 0
    return model, root


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids) if isinstance(model, Transformer) else model(input_ids=ids)
    return out.logits


def test_peft_loads_the_adapter_over_the_base_with_the_trained_logits(trained, base):
    from transformers import AutoModelForCausalLM

    model, root = trained
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    before = _logits(plain, ids)
    adapted = peft.PeftModel.from_pretrained(plain, root / "adapter").eval()
    ours = _logits(model, ids)
    assert float((ours - before).abs().max()) > 1e-3  # the adapters changed the model
    torch.testing.assert_close(_logits(adapted, ids), ours, rtol=1e-4, atol=1e-4)


def test_the_adapter_directory_is_peft_layout(trained, base):
    model, root = trained
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "r", "lora_alpha", "use_rslora", "base_model_name_or_path")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "use_rslora": False, "base_model_name_or_path": str(base)}
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    tensors = load_file(root / "adapter" / "adapter_model.safetensors")
    layers = model.cfg.n_layers
    assert len(tensors) == layers * 7 * 2
    A = tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"]
    B = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert A.shape == (4, model.cfg.dim) and B.shape == (model.cfg.dim, 4)
    assert torch.equal(A, model.get_submodule("layers.1.attention.wk.lora_A").weight)


def test_modules_to_save_travel_with_the_adapter(small_dataset, base, tmp_path):
    from transformers import AutoModelForCausalLM

    """... written at the end of the run by checkpoint.export_hf, as --lora-adapter would."""
    model = lora_run(small_dataset, base, tmp_path / "run", **{"train.lora.modules_to_save": "[lm_head]",
                                                             "train.lora.target_modules": "[q_proj, v_proj]",
                                                             "checkpoint.export_hf": True})
    convert(tmp_path / "run", tmp_path / "adapter", lora="adapter")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "run" / "hf" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes()
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert torch.equal(tensors["base_model.model.lm_head.weight"], model.output.weight)
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "run" / "hf").eval()
    ids = torch.randint(0, 4096, (1, 16))
    torch.testing.assert_close(_logits(adapted, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


def test_the_merged_directory_gives_the_trained_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    model, root = trained
    assert main(["convert", str(root / "run"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ids = torch.randint(0, 4096, (2, 20))
    torch.testing.assert_close(_logits(merged, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_tessera_serve_lora_serves_the_adapter_as_peft_decodes(trained, base):
    from transformers import AutoModelForCausalLM

    _, root = trained
    args = build_parser().parse_args(["serve", str(base), "--device", "cpu", "--lora", f"mine={root / 'adapter'}",
                                      "--num-blocks", "64"])
    engine = LLMEngine.from_dir(str(base), EngineConfig.from_args(args))
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), root / "adapter").eval()
    prompt = "def main("
    want = hf_greedy(adapted, engine.tokenizer.encode(prompt), 8)
    body = {"model": "mine", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with RunningServer(engine, name="base") as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]
    assert got == engine.tokenizer.decode(want)  # text: a random model's tokens need not re-encode as they were
    assert want != hf_greedy(AutoModelForCausalLM.from_pretrained(base), engine.tokenizer.encode(prompt), 8)


def test_a_lora_run_converts_only_as_an_adapter_or_merged(trained, small_dataset, tmp_path, capsys):
    _, root = trained
    assert main(["convert", str(root / "run"), str(tmp_path / "plain")]) == 2
    assert "was trained with train.lora: convert it with --lora-adapter" in capsys.readouterr().err
    assert not (tmp_path / "plain").exists()
    Trainer(load_config(TINY_DENSE, shrink(small_dataset, tmp_path / "full", 1))).train()
    assert main(["convert", str(tmp_path / "full"), str(tmp_path / "a"), "--lora-adapter"]) == 1
    assert "was trained without train.lora: it has no adapter" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--set parallel.\\* applies to HuggingFace -> Tessera only"):
        convert(root / "run", tmp_path / "b", lora="merge", layout=["parallel.tp=2"])
    with pytest.raises(SystemExit):
        main(["convert", str(root / "run"), str(tmp_path / "c"), "--lora-adapter", "--merge-lora"])


def test_tessera_eval_merges_the_adapter_as_the_merged_directory_scores(trained, base, tmp_path, monkeypatch):
    """`tessera eval BASE --merge-lora ADAPTER` scores as the merged HuggingFace directory does."""
    _, root = trained
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # examples/tasks
    convert(root / "run", tmp_path / "merged", lora="merge")
    task = ["--tasks", "python_syntax", "--include-path", "examples/tasks", "--limit", "6"]
    assert main(["eval", str(base), "--merge-lora", str(root / "adapter"), *task, "--output", str(tmp_path / "a")]) == 0
    assert main(["eval", str(tmp_path / "merged"), *task, "--output", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "a").read_text())
    assert report["config"]["engine"]["merge_lora"] == [str(root / "adapter")]
    a, b = report["results"]["python_syntax"], json.loads((tmp_path / "b").read_text())["results"]["python_syntax"]
    assert a["acc"] == pytest.approx(b["acc"]) and a["acc_norm"] == pytest.approx(b["acc_norm"])

"""gpt-oss's MXFP4 expert weights, dequantized at load: codes and exponents packed by hand per the
OCP microscaling format (two FP4 codes a byte, low nibble first; one exponent biased by 127 per 32
values; stored transposed) read back as the values they encode; a gpt-oss directory whose experts
are stored so loads with the logits of the transformers model holding those values, a rank's box of
experts reads only its experts, and `tessera convert` writes it in full precision."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.checkpoint.hf.mxfp4 import dequantize_mxfp4
from tessera.checkpoint.hf.slices import HFSliceReader
from tessera.cli import main
from tessera.hf import load_pretrained
from tests.infer.tiny_models import save_tokenizer
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def encode(codes_EOI: torch.Tensor, exps_EOG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks [E, O, G, 16], scales [E, O, G], the weight [E, I, O] they encode), written out value by value."""
    E, O, I = codes_EOI.shape
    pairs = codes_EOI.view(E, O, I // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    scales = (exps_EOG + 127).to(torch.uint8)
    weight = torch.empty(E, I, O)
    for e in range(E):
        for o in range(O):
            for i in range(I):
                weight[e, i, o] = FP4[codes_EOI[e, o, i]] * 2.0 ** int(exps_EOG[e, o, i // 32])
    return blocks, scales, weight


def random_codes(shape_EOI, seed):
    gen = torch.Generator().manual_seed(seed)
    E, O, I = shape_EOI
    return torch.randint(0, 16, shape_EOI, generator=gen), torch.randint(-6, 2, (E, O, I // 32), generator=gen)


def test_packed_codes_and_exponents_decode_to_their_values():
    codes, exps = random_codes((2, 3, 64), 0)
    codes[0, 0, :4] = torch.tensor([7, 9, 1, 15])  # 6, -0.5, 0.5, -6
    exps[0, 0, 0] = 1
    blocks, scales, weight = encode(codes, exps)
    assert blocks[0, 0, 0, :2].tolist() == [7 | 9 << 4, 1 | 15 << 4]
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (2, 64, 3) and out[0, :4, 0].tolist() == [12.0, -1.0, 1.0, -12.0]
    assert torch.equal(out, weight)


def _mxfp4_gpt_oss(path):
    """A tiny gpt-oss whose expert weights are MXFP4-representable, saved with them packed."""
    cfg = hf_configs()["gpt_oss"]
    cfg.intermediate_size, cfg.num_local_experts = 32, 4  # MXFP4 blocks of 32 along D = 32 and F = 32
    cfg.vocab_size = 128  # the character tokenizer's
    hf = random_hf_model(cfg)
    packed = {}
    for i in range(cfg.num_hidden_layers):
        experts = hf.model.layers[i].mlp.experts
        for n, (rows, cols) in (("gate_up_proj", (64, 32)), ("down_proj", (32, 32))):
            blocks, scales, weight = encode(*random_codes((4, rows, cols), 10 * i + len(n)))
            getattr(experts, n).data.copy_(weight)
            packed[f"model.layers.{i}.mlp.experts.{n}"] = (blocks, scales)
    hf.save_pretrained(path)
    save_tokenizer(path)
    tensors = load_file(path / "model.safetensors")
    for key, (blocks, scales) in packed.items():
        del tensors[key]
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((path / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                  "model.layers.*.mlp.router"]}
    (path / "config.json").write_text(json.dumps(d))
    return hf


def test_an_mxfp4_directory_loads_dequantized_with_transformers_logits(tmp_path):
    hf = _mxfp4_gpt_oss(tmp_path / "hf")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    model = load_pretrained(tmp_path / "hf")
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids).logits, want, atol=1e-4, rtol=1e-4)
    reader = HFSliceReader(tmp_path / "hf", model.cfg)
    whole = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    assert reader.shape("layers.1.moe.experts.gate_up_proj") == (4, 32, 64)
    assert torch.equal(reader.read("layers.1.moe.experts.gate_up_proj", (2, 0, 8), (2, 32, 16)), whole[2:4, :, 8:24])

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, want, atol=1e-4, rtol=1e-4)


def test_hf_codes_repacked_as_gguf_blocks_decode_to_the_same_values():
    from tessera.checkpoint.hf.mxfp4_packed import gguf_mxfp4_rows
    from tessera.models.gguf_blocks import dequantize

    codes, exps = random_codes((2, 3, 64), 5)
    blocks, scales, weight = encode(codes, exps)
    rows = gguf_mxfp4_rows(blocks, scales)
    assert rows.shape == (2, 3, 2 * 17) and rows.dtype == torch.uint8
    got = torch.stack([dequantize("MXFP4", rows[e], (3, 64)) for e in range(2)])  # [E, O, I]
    assert torch.equal(got, weight.transpose(-1, -2))


def test_an_mxfp4_directory_is_served_with_its_experts_kept_packed(tmp_path):
    """By default the engine keeps gpt-oss's MXFP4 experts packed (`Mxfp4Experts`, 17 bytes per 32
    values) and decodes transformers' greedy tokens; `--gguf-dequantize` loads them dequantized;
    the option is refused for a directory that holds no such experts."""
    from tessera.checkpoint.hf.mxfp4_packed import load_mxfp4_packed
    from tessera.checkpoint.loading import load_model
    from tessera.config.errors import ConfigError
    from tessera.infer import LLM, SamplingParams
    from tessera.models.moe.mxfp4_experts import Mxfp4Experts
    from tests.infer.tiny_models import hf_greedy

    hf = _mxfp4_gpt_oss(tmp_path / "hf")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    kept = load_mxfp4_packed(tmp_path / "hf")
    experts = kept.layers["1"].moe.experts
    assert isinstance(experts, Mxfp4Experts) and experts.down_blocks.shape == (4, 32, 17)
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, hf(ids).logits, atol=1e-4, rtol=1e-4)
    prompt = ids[0].tolist()
    llm = LLM(str(tmp_path / "hf"), max_num_seqs=1, max_model_len=48, block_size=4)
    assert isinstance(llm.engine.model.layers["0"].moe.experts, Mxfp4Experts)
    got = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == hf_greedy(hf, prompt, 10)
    plain = LLM(str(tmp_path / "hf"), gguf_keep_quantized=False, max_num_seqs=1, max_model_len=48, block_size=4)
    assert not isinstance(plain.engine.model.layers["0"].moe.experts, Mxfp4Experts)
    random_hf_model(hf_configs()["llama"]).save_pretrained(tmp_path / "plain")
    with pytest.raises(ConfigError, match="GGUF files and MXFP4 directories"):
        load_model(tmp_path / "plain", gguf_keep_quantized=True)

"""A GGUF model loaded with its quantized attention/MLP matrices kept in the file's blocks
(`gguf_keep_quantized`): the same logits as the model dequantized at load from the same file (the
dequantized weights are the same bits, so the products are too), the same greedy tokens through
the engine, the file's bytes in memory instead of 4 bytes per weight, and the options it cannot go
with refused by name. Kept is the default for a GGUF file (`--gguf-dequantize` opts out), except
where an option needs the weights dequantized: there the default dequantizes, so a command that
served the file before still does; the two switches together are a usage error."""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.gguf import TENSOR_TYPES, GGUFFile, load_gguf
from tessera.checkpoint.loading import load_model
from tessera.cli import build_parser, main
from tessera.cli.serve import _check_server_options
from tessera.config.errors import ConfigError
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.models.gguf_blocks import BLOCKS
from tessera.models.gguf_linear import GgufEmbedding, GgufLinear
from tessera.models.quantized import Int8Linear
from tests.checkpoint.gguf_files import LLAMA_LIKE, tiny_hf_model, write_gguf

PROMPT = "def main():\n    return"
# Every matrix in a block type, so that LLaMA's permuted query/key rows are kept as blocks too.
BLOCK_TYPES = ("Q6_K", "Q8_0", "Q4_K", "Q5_K", "Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, types) -> a tiny GGUF file: every type Tessera reads, or block types only."""
    root = tmp_path_factory.mktemp("gguf-kept")
    return {(arch, kinds): write_gguf(tiny_hf_model(arch, seed=3), root / f"{arch}-{len(kinds)}.gguf", kinds)
            for arch in LLAMA_LIKE for kinds in (TENSOR_TYPES, BLOCK_TYPES)}


def _kept_layers(model) -> dict[str, GgufLinear]:
    """The blocks' kept layers (the head, kept or not, is checked on its own)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, GgufLinear) and name.startswith("layers.")}


@pytest.mark.parametrize("arch", list(LLAMA_LIKE))
@pytest.mark.parametrize("kinds", [TENSOR_TYPES, BLOCK_TYPES], ids=["every-type", "block-types"])
def test_kept_blocks_give_the_logits_of_the_dequantized_model(arch, kinds, files):
    path = files[arch, kinds]
    dense, kept = load_gguf(path), load_gguf(path, keep_quantized=True)
    ids = torch.randint(0, 4096, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, dense(ids).logits, rtol=1e-6, atol=1e-6)
    # Which layers are kept: every attention/MLP matrix the file stores in a block type, no other.
    stored = {s.hf_name: s for s in GGUFFile.open(path).stored()}
    layers = _kept_layers(kept)
    in_blocks = [s for name, s in stored.items() if ".layers." in name and s.kind in BLOCKS and name.endswith("weight")]
    assert len(layers) == len(in_blocks) > 0
    assert {m.kind for m in layers.values()} == {s.kind for s in in_blocks}
    if kinds == BLOCK_TYPES:
        assert len(layers) == 2 * 7 and "layers.0.attention.wq" in layers and "layers.0.attention.wk" in layers
    # The embedding and the head: kept where the file stores them in a block type; a tied head is a
    # GgufLinear over the embedding's own buffer (one copy).
    embedding = stored["model.embed_tokens.weight"]
    assert isinstance(kept.tok_embeddings, GgufEmbedding) == (embedding.kind in BLOCKS)
    if kept.cfg.tie_embeddings:
        assert isinstance(kept.output, GgufLinear) == (embedding.kind in BLOCKS)
        if embedding.kind in BLOCKS:
            assert kept.output.blocks.untyped_storage().data_ptr() == kept.tok_embeddings.blocks.data_ptr()
    else:
        assert isinstance(kept.output, GgufLinear) == (stored["lm_head.weight"].kind in BLOCKS)


def test_resident_bytes_of_kept_layers_are_the_files(files):
    """Each kept matrix holds exactly its tensor's bytes in the file, as uint8, and no float weight."""
    path = files["llama", BLOCK_TYPES]
    model = load_gguf(path, keep_quantized=True)
    stored = {s.hf_name: s for s in GGUFFile.open(path).stored()}
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
    kept_bytes = dense_bytes = 0
    for name, layer in _kept_layers(model).items():
        _, i, local = name.split(".", 2)
        entry = stored[f"model.layers.{i}.{names[local]}.weight"]
        assert layer.blocks.dtype == torch.uint8 and layer.blocks.nbytes == entry.nbytes
        assert not any(p.dtype.is_floating_point and p.dim() == 2 for p in layer.parameters())
        kept_bytes += layer.blocks.nbytes
        dense_bytes += layer.in_features * layer.out_features * 4
    assert kept_bytes < dense_bytes / 4  # 2.6 to 8.5 bits per weight here, against float32's 32


def test_engine_greedy_tokens_equal_the_dequantized_path(files):
    path = files["llama", BLOCK_TYPES]
    options = dict(max_num_seqs=2, max_model_len=64, block_size=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    dense = LLM(path, gguf_keep_quantized=False, **options).generate([PROMPT, "x = 1"], params)
    kept_llm = LLM(path, gguf_keep_quantized=True, **options)
    assert _kept_layers(kept_llm.engine.model)
    kept = kept_llm.generate([PROMPT, "x = 1"], params)
    assert [c.token_ids for c in kept] == [c.token_ids for c in dense]


def test_bfloat16_kept_equals_bfloat16_dequantized(files):
    path = files["qwen2", BLOCK_TYPES]
    ids = torch.arange(7, 30)[None]
    with torch.no_grad():
        dense = load_gguf(path, torch.bfloat16)(ids).logits
        kept = load_gguf(path, torch.bfloat16, keep_quantized=True)(ids).logits
    torch.testing.assert_close(kept, dense, rtol=0, atol=0)


def test_options_it_cannot_go_with_are_refused_by_name(files, tmp_path):
    for key, value in (("quantization", "int8"), ("lora_adapters", {"a": str(tmp_path)}),
                       ("merge_lora", [str(tmp_path)])):
        with pytest.raises(ConfigError, match=rf"{key}=.* is invalid: not supported with gguf_keep_quantized=True"):
            EngineConfig(gguf_keep_quantized=True, **{key: value})
    EngineConfig(gguf_keep_quantized=True, tensor_parallel_size=2)  # each rank its part (test_gguf_tensor_parallel)
    hf = tmp_path / "hf"
    tiny_hf_model("llama").save_pretrained(hf)
    with pytest.raises(ConfigError, match="applies to GGUF files and MXFP4 directories .*; .* is neither"):
        load_model(hf, gguf_keep_quantized=True)
    engine = LLMEngine.from_dir(files["llama", BLOCK_TYPES], EngineConfig(gguf_keep_quantized=True, num_blocks=8,
                                                                        block_size=4, max_model_len=16))
    with pytest.raises(ConfigError, match="LoRA adapters are not supported with gguf_keep_quantized=True"):
        engine.load_lora("a", tmp_path)  # a runtime adapter (the server's /v1/load_lora_adapter)
    engine.close()


def test_serve_refuses_those_options_with_exit_2(files, tmp_path, capsys):
    path = str(files["llama", BLOCK_TYPES])
    for extra, message in ((["--quantization", "int8"], "quantization='int8' is invalid"),
                           (["--allow-runtime-lora", "--lora-modules-dir", str(tmp_path)],
                            "--allow-runtime-lora is not supported with --gguf-keep-quantized")):
        assert main(["serve", path, "--gguf-keep-quantized", "--port", "0", *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_generate_kept_quantized_prints_the_dequantized_text(files, capsys):
    path = str(files["qwen2", BLOCK_TYPES])
    texts = []
    for extra in (["--gguf-dequantize"], [], ["--gguf-keep-quantized"], ["--gguf-keep-quantized", "--no-cache"],
                  ["--quantization", "int8"]):  # the last: int8 of the dequantized weights, as before the default
        assert main(["generate", path, "--prompt", PROMPT, "--max-new-tokens", "6", *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] == texts[3] and texts[0].startswith(PROMPT)
    assert texts[4].startswith(PROMPT)
    assert main(["generate", path, "--prompt", PROMPT, "--gguf-keep-quantized", "--quantization", "int8"]) == 2
    assert "--quantization int8 is not supported with --gguf-keep-quantized" in capsys.readouterr().err


def test_a_gguf_file_is_kept_quantized_by_default_and_dequantized_on_request(files, tmp_path):
    path = files["llama", BLOCK_TYPES]
    options = dict(max_num_seqs=1, max_model_len=32, block_size=4)
    default, opted_out = LLM(path, **options), LLM(path, gguf_keep_quantized=False, **options)
    assert len(_kept_layers(default.engine.model)) == 2 * 7 and not _kept_layers(opted_out.engine.model)
    # settled as the file loads (the caller's config unchanged): runtime adapters are refused on it
    assert default.config.gguf_keep_quantized is None and default.engine.config.gguf_keep_quantized is True
    with pytest.raises(ConfigError, match="LoRA adapters are not supported with gguf_keep_quantized=True"):
        default.engine.load_lora("a", tmp_path)
    opted_out.engine.close()
    default.engine.close()


def test_the_default_dequantizes_where_an_option_needs_it(files, tmp_path):
    assert EngineConfig().gguf_blocks_kept(True) and not EngineConfig().gguf_blocks_kept(False)
    assert not EngineConfig(gguf_keep_quantized=False).gguf_blocks_kept(True)
    for fields in ({"quantization": "int8"}, {"lora_adapters": {"a": str(tmp_path)}}, {"merge_lora": [str(tmp_path)]},
                   {"tensor_parallel_size": 2}):
        assert not EngineConfig(**fields).gguf_blocks_kept(True), fields  # not refused either: dequantized
    llm = LLM(files["llama", BLOCK_TYPES], quantization="int8", max_num_seqs=1, max_model_len=32, block_size=4)
    assert not _kept_layers(llm.engine.model) and any(isinstance(m, Int8Linear) for m in llm.engine.model.modules())
    assert llm.engine.config.gguf_keep_quantized is False
    llm.engine.close()


def test_serve_switches_contradictory_or_runtime_lora(files, tmp_path, capsys):
    path = str(files["llama", BLOCK_TYPES])
    with pytest.raises(SystemExit) as exit_status:
        main(["serve", path, "--gguf-keep-quantized", "--gguf-dequantize", "--port", "0"])
    assert exit_status.value.code == 2
    assert "--gguf-dequantize: not allowed with argument --gguf-keep-quantized" in capsys.readouterr().err

    def served(*extra):
        return _check_server_options(build_parser().parse_args(["serve", path, *extra]))[0].gguf_keep_quantized

    assert served() is None and served("--gguf-keep-quantized") is True and served("--gguf-dequantize") is False
    # adapters may be loaded while serving: the default dequantizes instead of refusing them
    assert served("--allow-runtime-lora", "--lora-modules-dir", str(tmp_path)) is False

"""A GGUF file served with its block matrices kept quantized (`gguf_keep_quantized`) over two
tensor-parallel ranks: each rank holds its part of the file's blocks (column-parallel layers their
output rows, row-parallel ones their input columns, whole blocks) and multiplies by them, and the
greedy tokens are those of one rank serving the same blocks. A row-parallel split that falls inside
a block (Q4_K's 256 values over 128 columns a rank) is refused by the layer's name, as are blocks
the ranks cannot share (gpt-oss's packed MXFP4 experts) and a source that is not a GGUF file."""

from __future__ import annotations

import pytest
import torch

from tessera.checkpoint.gguf import load_gguf
from tessera.config.errors import ConfigError
from tessera.infer import LLM, SamplingParams
from tessera.infer.runner import gguf_shards
from tessera.models.gguf_blocks import BLOCKS, row_bytes
from tessera.models.gguf_linear import GgufLinear
from tests.checkpoint.gguf_files import tiny_hf_model, write_gguf
from tests.checkpoint.gguf_more_family_files import mxfp4_experts, tiny_model
from tests.checkpoint.gguf_more_family_files import write_gguf as write_gguf_family

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello world", "The quick brown fox jumps over", "zz"]
OPTIONS = dict(gguf_keep_quantized=True, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
# block types of 32 values: every split of the tiny model's 256 / 512 columns in two falls on a block edge
SMALL_BLOCKS = ("Q8_0", "Q4_1", "Q5_0", "Q4_0", "Q5_1")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2: q / k / v biases cut with the rows
def test_two_ranks_serve_their_parts_of_the_blocks_as_one_rank_serves_them(arch, tmp_path):
    path = write_gguf(tiny_hf_model(arch, seed=3), tmp_path / f"{arch}.gguf", SMALL_BLOCKS)
    one = LLM(str(path), **OPTIONS)
    whole = {n: m for n, m in one.engine.model.named_modules() if isinstance(m, GgufLinear)}
    want = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    one.engine.close()
    with LLM(str(path), tensor_parallel_size=2, **OPTIONS) as two:
        parts = {n: m for n, m in two.engine.executor.model.named_modules() if isinstance(m, GgufLinear)}
        assert parts.keys() == whole.keys() and len(parts) == 2 * 7 + 1  # the head too: its vocab rows cut
        for name, part in parts.items():
            full = whole[name]
            row_parallel = name.endswith(("wo", "w2"))
            assert part.kind == full.kind and part.blocks.dtype == torch.uint8
            assert (part.in_features, part.out_features) == ((full.in_features // 2, full.out_features) if row_parallel
                                                             else (full.in_features, full.out_features // 2))
            assert tuple(part.blocks.shape) == (part.out_features, row_bytes(part.kind, part.in_features))
            assert bool(part._forward_hooks) == row_parallel  # the partial products summed over the ranks
        first = parts["layers.0.attention.wq"]
        assert first.blocks.equal(whole["layers.0.attention.wq"].blocks[:first.out_features])  # rank 0's rows
        assert [o.token_ids for o in two.generate(PROMPTS, GREEDY)] == want


@pytest.mark.dist
@pytest.mark.slow
def test_a_row_parallel_split_inside_a_block_is_refused_by_name(tmp_path):
    path = write_gguf(tiny_hf_model("llama", seed=3), tmp_path / "q4k.gguf", ("Q4_K",))
    values = BLOCKS["Q4_K"][0]
    with pytest.raises(ConfigError, match=rf"cuts layers\.0\.attention\.wo's 256 input columns at 0\.\.128, inside its "
                                          rf"Q4_K blocks of {values} values.*--gguf-dequantize"):
        LLM(str(path), tensor_parallel_size=2, **OPTIONS)


def test_blocks_the_ranks_cannot_share_are_refused_before_any_cut(tmp_path):
    """gpt-oss's MXFP4 experts kept packed are not cut (expert tensor parallelism cuts float experts), and
    a source that is not a GGUF file (a directory; an MXFP4 one keeps its experts packed on one rank) is
    refused before any process starts."""
    hf = tiny_model("gpt-oss", seed=2)
    mxfp4_experts(hf)
    model = load_gguf(write_gguf_family(hf, tmp_path / "mxfp4.gguf", "gpt-oss", mxfp4=True), keep_quantized=True)
    with pytest.raises(ConfigError, match=r"cannot cut layers\.0\.moe\.experts \(Mxfp4Experts.*--gguf-dequantize"):
        gguf_shards.stand_in(model)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"gguf_keep_quantized=True with tensor_parallel_size=2 applies to GGUF "
                                          r"files .* is not one"):
        LLM(str(tmp_path / "hf"), tensor_parallel_size=2, **OPTIONS)

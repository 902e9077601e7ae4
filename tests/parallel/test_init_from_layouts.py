"""`train.init_from` under a parallel layout: every rank reads only its shards of the HuggingFace
directory (or Tessera checkpoint), and the first training step equals the one-process run started
from the same directory (fp32, 1e-5 relative), for every family the HuggingFace adapters know.

The HuggingFace directories are written by `save_pretrained` from a Tessera model of the run's own
shape whose every weight (norms and expert biases included) is random, so a tensor loaded into the
wrong place, or left at its seed initialisation, changes the loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.checkpoint.hf.slices import local_box
from tessera.config.schema import load_config
from tessera.hf import load_pretrained, save_pretrained
from tessera.models import Transformer
from tessera.train.trainer import Trainer
from tests.forked_ranks import run_ranks
from tests.parallel.trainer_runs import EQUALITY_OVERRIDES, assert_same_training, whole_parameters
from tests.train.runs import TINY_DEEPSEEK, TINY_DENSE, TINY_MOE, deepseek_shrink, moe_shrink, shrink

# family -> (config, shrink function, model overrides that make the tiny config that family)
FAMILIES = {
    "llama": (TINY_DENSE, shrink, {}),
    "llama_tied": (TINY_DENSE, shrink, {"model.tie_embeddings": True}),
    "mistral": (TINY_DENSE, shrink, {"model.family": "mistral", "model.sliding_window": 8}),
    "qwen2": (TINY_DENSE, shrink, {"model.family": "qwen2", "model.qkv_bias": True}),
    "qwen3": (TINY_DENSE, shrink, {"model.family": "qwen3", "model.qk_norm": True}),
    "smollm3": (TINY_DENSE, shrink, {"model.family": "smollm3", "model.nope_layers": [1]}),
    "olmo2": (TINY_DENSE, shrink, {"model.family": "olmo2", "model.block_norms": "post", "model.qk_norm": True,
                                   "model.qk_norm_all_heads": True}),
    "olmo3": (TINY_DENSE, shrink, {"model.family": "olmo3", "model.block_norms": "post", "model.qk_norm": True,
                                   "model.qk_norm_all_heads": True, "model.sliding_window": 8,
                                   "model.window_layers": [0], "model.local_rope_theta": 5000.0}),
    "seed_oss": (TINY_DENSE, shrink, {"model.family": "seed_oss", "model.qkv_bias": True, "model.head_dim": 8}),
    "exaone4": (TINY_DENSE, shrink, {"model.family": "exaone4", "model.block_norms": "post", "model.qk_norm": True,
                                     "model.sliding_window": 8, "model.window_layers": [0], "model.nope_layers": [1]}),
    "phi3": (TINY_DENSE, shrink, {"model.family": "phi3", "model.sliding_window": 8, "model.partial_rotary_factor": 0.5,
                                  "model.rope_scaling": "{rope_type: longrope, factor: 4.0, original_max_position_embeddings: 16, short_factor: [1.0, 1.2, 2.0, 3.0], long_factor: [1.5, 2.5, 4.0, 8.0]}"}),  # noqa: E501
    "gemma3_text": (TINY_DENSE, shrink, {"model.family": "gemma3_text", "model.block_norms": "pre_post", "model.qk_norm": True, "model.norm_unit_offset": True, "model.activation": "gelu_tanh", "model.embed_scale": True, "model.query_pre_attn_scalar": 20.0, "model.sliding_window": 8, "model.window_layers": [0], "model.local_rope_theta": 5000.0, "model.tie_embeddings": True}),  # noqa: E501
    "mixtral": (TINY_MOE, moe_shrink, {}),
    "llama4_text": (TINY_MOE, moe_shrink, {
        "model.family": "llama4_text", "model.moe.top_k": 1, "model.moe.score_func": "sigmoid",
        "model.moe.norm_topk_prob": False, "model.moe.gate_input": True, "model.moe.shared_ffn_dim": 32,
        "model.moe.dense_layers": [0], "model.attention_chunk_size": 8, "model.nope_layers": [1],
        "model.qk_l2_norm": True, "model.nope_attn_scale": 0.5, "model.nope_floor_scale": 4,
        "model.rope_interleave": True}),
    "qwen2_moe": (TINY_MOE, moe_shrink, {"model.family": "qwen2_moe", "model.qkv_bias": True,
                                         "model.moe.shared_ffn_dim": 32,
                                         "model.moe.shared_expert_gate": True, "model.moe.norm_topk_prob": False}),
    "qwen3_moe": (TINY_MOE, moe_shrink, {"model.family": "qwen3_moe", "model.qk_norm": True}),
    "deepseek_v3": (TINY_DEEPSEEK, deepseek_shrink, {}),
    "glm4_moe": (TINY_MOE, moe_shrink, {"model.family": "glm4_moe", "model.qkv_bias": True, "model.qk_norm": True, "model.partial_rotary_factor": 0.5, "model.moe.score_func": "sigmoid", "model.moe.expert_bias": True, "model.moe.first_k_dense": 1, "model.moe.shared_ffn_dim": 32, "model.moe.n_groups": 2, "model.moe.aux_loss_coef": 0.0}),  # noqa: E501
    "gpt_oss": (TINY_MOE, moe_shrink, {"model.family": "gpt_oss", "model.qkv_bias": True, "model.out_bias": True, "model.attention_sinks": True, "model.sliding_window": 8, "model.window_layers": [0], "model.moe.softmax_before_topk": False, "model.moe.router_bias": True, "model.moe.expert_activation": "clamped_swiglu"}),  # noqa: E501
    # experts packed in the files (gate_up_proj, down_proj): an ep rank reads its experts' rows of them
    "qwen3_5_moe_text": (TINY_MOE, moe_shrink, {"model.family": "qwen3_5_moe_text", "model.qk_norm": True, "model.partial_rotary_factor": 0.25, "model.attention_output_gate": True, "model.norm_unit_offset": True, "model.ffn_dim": 32, "model.moe.shared_ffn_dim": 32, "model.moe.shared_expert_gate": True, "model.linear_attention": "{layers: [0], n_key_heads: 2, n_value_heads: 4, key_head_dim: 8, value_head_dim: 8, projections: split, chunk_size: 8}"}),  # noqa: E501
}
TP2 = {"parallel.tp": 2, "parallel.dp_shard": 1}
PP2 = {"parallel.pp": 2, "parallel.dp_shard": 1}
TP2_PP2 = {"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 1}
EP2_FSDP2 = {"parallel.ep": 2, "parallel.dp_shard": 2}
FSDP2 = {"parallel.dp_shard": 2}
TP2_SP = {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1}


def family_overrides(family: str, dataset: str, run_dir: Path, **extra: object) -> list[str]:
    _, shrink_fn, model = FAMILIES[family]
    return shrink_fn(dataset, run_dir, 1, **{**EQUALITY_OVERRIDES, **model, **extra})


def write_hf(family: str, dataset: str, path: Path) -> Path:
    """A HuggingFace directory of the run's model shape with every weight and buffer random."""
    cfg = load_config(FAMILIES[family][0], family_overrides(family, dataset, path / "unused"))
    model = Transformer(cfg.model, init_seed=None)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.05 * noise)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))
    save_pretrained(model, path)
    return path


def train_family(config: str, overrides: list[str]) -> dict:
    """Runs on every rank: one step through the real Trainer; records, whole weights, bytes read."""
    trainer = Trainer(load_config(config, overrides))
    read = trainer.init_bytes_read
    result = trainer.train()
    return {"records": result.records, "weights": whole_parameters(trainer.parts), "bytes_read": read}


_hf_dirs: dict = {}
_references: dict = {}


def hf_and_reference(family: str, dataset: str, tmp_path_factory) -> tuple[Path, dict]:
    """The family's HuggingFace directory and the one-process run started from it (cached)."""
    if family not in _hf_dirs:
        _hf_dirs[family] = write_hf(family, dataset, tmp_path_factory.mktemp(f"hf-{family}"))
        run = tmp_path_factory.mktemp("reference")
        overrides = family_overrides(family, dataset, run, **{"train.init_from": _hf_dirs[family]})
        _references[family] = train_family(FAMILIES[family][0], overrides)
    return _hf_dirs[family], _references[family]


def _case(family: str, world: int, parallel: dict, name: str, slow: bool = True):
    return pytest.param(family, world, parallel, id=f"{family}-{name}", marks=[pytest.mark.slow] if slow else [])


LAYOUTS = [
    _case("llama", 2, TP2, "tp2", slow=False),
    _case("llama", 2, FSDP2, "fsdp2"),
    _case("llama", 2, PP2, "pp2"),
    _case("llama", 4, TP2_PP2, "tp2-pp2"),
    _case("mixtral", 2, EP2_FSDP2, "ep2-fsdp2", slow=False),
    _case("mixtral", 2, TP2, "tp2"),
    _case("mixtral", 2, PP2, "pp2"),
    _case("mixtral", 4, TP2_PP2, "tp2-pp2"),
    _case("qwen3_moe", 4, TP2_PP2, "tp2-pp2", slow=False),
    _case("qwen3_moe", 2, TP2, "tp2"),
    _case("qwen3_moe", 2, EP2_FSDP2, "ep2-fsdp2"),
    _case("qwen3_moe", 2, PP2, "pp2"),
    _case("deepseek_v3", 2, PP2, "pp2"),
    _case("deepseek_v3", 2, TP2, "tp2"),
    _case("deepseek_v3", 2, EP2_FSDP2, "ep2-fsdp2", slow=False),
    _case("deepseek_v3", 4, TP2_PP2, "tp2-pp2"),
    # tied embeddings: the first and last stage each fill their copy, vocabulary-sharded under tp
    _case("llama_tied", 4, TP2_PP2, "tp2-pp2", slow=False),
    _case("mistral", 2, TP2, "tp2"),
    _case("qwen2", 2, TP2, "tp2"),
    _case("qwen3", 2, PP2, "pp2"),
    _case("smollm3", 2, TP2, "tp2"),
    _case("smollm3", 2, PP2, "pp2"),
    _case("olmo2", 2, FSDP2, "fsdp2"),
    _case("olmo2", 2, PP2, "pp2"),
    _case("olmo3", 2, FSDP2, "fsdp2"),
    _case("olmo3", 2, PP2, "pp2"),
    _case("seed_oss", 2, TP2, "tp2"),
    _case("exaone4", 2, TP2, "tp2"),
    _case("exaone4", 2, PP2, "pp2"),
    _case("qwen2_moe", 2, EP2_FSDP2, "ep2-fsdp2"),
    _case("llama4_text", 2, EP2_FSDP2, "ep2-fsdp2"),
    _case("llama4_text", 2, TP2, "tp2"),
    _case("llama4_text", 2, PP2, "pp2"),
    _case("glm4_moe", 2, EP2_FSDP2, "ep2-fsdp2"),
    _case("gpt_oss", 2, EP2_FSDP2, "ep2-fsdp2"),
    _case("gpt_oss", 2, TP2, "tp2"),
    _case("gpt_oss", 2, PP2, "pp2"),
    _case("glm4_moe", 2, PP2, "pp2"),
    _case("phi3", 2, TP2_SP, "tp2-sp", slow=False),  # the fused qkv_proj / gate_up_proj read as each rank's box of rows
    _case("phi3", 2, PP2, "pp2"),
    _case("phi3", 2, FSDP2, "fsdp2"),
    _case("gemma3_text", 2, TP2_SP, "tp2-sp", slow=False),  # scaled embeddings cut over the vocabulary
    _case("gemma3_text", 2, PP2, "pp2"),
    _case("gemma3_text", 2, FSDP2, "fsdp2"),
    _case("qwen3_5_moe_text", 2, EP2_FSDP2, "ep2-fsdp2", slow=False),
]


@pytest.mark.dist
@pytest.mark.parametrize("family,world,parallel", LAYOUTS)
def test_init_from_huggingface_under_a_layout_equals_one_process(family, world, parallel, small_dataset, tmp_path,
                                                                 tmp_path_factory):
    hf, ref = hf_and_reference(family, small_dataset, tmp_path_factory)
    overrides = family_overrides(family, small_dataset, tmp_path, **{"train.init_from": hf, **parallel})
    got = run_ranks(train_family, world, FAMILIES[family][0], overrides)
    assert_same_training(got, ref, rtol=1e-5)
    whole = ref["bytes_read"]
    assert all(0 < r["bytes_read"] < whole for r in got)  # no rank read the whole model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_process_init_from_equals_the_whole_model_loader(family, small_dataset, tmp_path):
    """The filler on one process gives every parameter and buffer (expert biases included) what the
    whole-model HuggingFace loader gives it."""
    hf = write_hf(family, small_dataset, tmp_path / "hf")
    trainer = Trainer(load_config(FAMILIES[family][0], family_overrides(family, small_dataset, tmp_path / "run",
                                                                         **{"train.init_from": hf})))
    want = load_pretrained(hf).state_dict()
    got = trainer.model.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert trainer.init_bytes_read == sum(v.numel() * v.element_size() for v in want.values())


def _init_only(config: str, overrides: list[str]) -> dict:
    """Runs on every rank: build the Trainer (weights read from train.init_from); what this rank read,
    the box of every tensor it holds, and the bytes of its sharded and replicated tensors."""
    trainer = Trainer(load_config(config, overrides))
    boxes, sharded, replicated, own = {}, 0, 0, 0
    for part in trainer.parts:
        for name, t in part.state_dict(keep_vars=True).items():
            boxes[name] = local_box(t)
            local = t.to_local() if isinstance(t, DTensor) else t
            whole = t.numel() * t.element_size()
            own += local.numel() * local.element_size()
            if local.numel() < t.numel():
                sharded += whole
            else:
                replicated += whole
    return {"bytes_read": trainer.init_bytes_read, "boxes": boxes, "sharded": sharded, "replicated": replicated,
            "own": own}


@pytest.mark.dist
def test_each_rank_reads_about_its_share_of_the_huggingface_weights(small_dataset, tmp_path, tmp_path_factory):
    """4 ranks, experts over ep=2 and every weight sharded over dp_shard=4: a rank reads its shards and
    the replicated tensors, about a quarter of the model."""
    hf, ref = hf_and_reference("mixtral", small_dataset, tmp_path_factory)
    parallel = {"parallel.ep": 2, "parallel.dp_shard": 4, "train.micro_batch_size": 1, "train.init_from": hf}
    got = run_ranks(_init_only, 4, TINY_MOE, family_overrides("mixtral", small_dataset, tmp_path, **parallel))
    whole = ref["bytes_read"]
    for r in got:
        assert r["sharded"] > 0.9 * whole
        assert r["bytes_read"] == r["own"]  # exactly the boxes this rank holds ...
        assert r["bytes_read"] <= 1.1 * (r["sharded"] / 4 + r["replicated"])  # ... about 1/world of the model
        assert r["bytes_read"] < whole / 3


# tp=2 x ep=2 x dp_shard=2 on 4 ranks: every kind of cut (vocabulary, heads, experts, FSDP rows)
CONVERT_LAYOUT = {"parallel.tp": 2, "parallel.ep": 2, "parallel.dp_shard": 2}


@pytest.mark.dist
def test_convert_writes_the_shards_of_a_layout_and_it_trains_like_the_huggingface_directory(
        small_dataset, tmp_path, tmp_path_factory):
    from tessera.checkpoint.dcp.reader import read_dcp_metadata
    from tessera.cli import main

    family = "qwen3_moe"
    hf, ref = hf_and_reference(family, small_dataset, tmp_path_factory)
    dst = tmp_path / "sharded"
    assert main(["convert", str(hf), str(dst), *[a for k, v in CONVERT_LAYOUT.items()
                                                  for a in ("--set", f"{k}={v}")]]) == 0
    step = dst / "step_00000000"
    config = FAMILIES[family][0]
    # The ranks of that layout, started for real: the boxes they hold are the checkpoint's chunks.
    got = run_ranks(_init_only, 4, config, family_overrides(family, small_dataset, tmp_path / "boxes",
                                                           **CONVERT_LAYOUT, **{"train.init_from": dst}))
    metadata = read_dcp_metadata(step).state_dict_metadata
    for key, md in metadata.items():
        chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}
        held = {r["boxes"][key.removeprefix("model.")] for r in got}
        assert chunks == held, key
        assert len(md.chunks) == len(chunks)
    assert {k.removeprefix("model.") for k in metadata} == set(got[0]["boxes"])
    for r in got:  # each rank read its own chunks only (stored with a small header each)
        assert r["own"] <= r["bytes_read"] < 1.1 * r["own"]
    # The same first step from the converted checkpoint: under its layout, another one, one process.
    for world, parallel in ((4, CONVERT_LAYOUT), (2, TP2)):
        run = tmp_path / f"run{world}"
        trained = run_ranks(train_family, world, config,
                            family_overrides(family, small_dataset, run, **parallel, **{"train.init_from": dst}))
        assert_same_training(trained, ref, rtol=1e-5)
    one = train_family(config, family_overrides(family, small_dataset, tmp_path / "one", **{"train.init_from": dst}))
    assert_same_training([one], ref, rtol=1e-5)


def test_convert_set_takes_parallel_keys_only(small_dataset, tmp_path, tmp_path_factory, capsys):
    from tessera.cli import main

    hf, _ = hf_and_reference("llama", small_dataset, tmp_path_factory)
    assert main(["convert", str(hf), str(tmp_path / "a"), "--set", "train.steps=3"]) == 2
    assert "only parallel.* keys" in capsys.readouterr().err
    assert main(["convert", str(hf), str(tmp_path / "b"), "--set", "parallel.tp=3"]) == 2
    assert "tp" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "step_00000000").exists()

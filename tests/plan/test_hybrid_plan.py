"""The planner sizes a hybrid model's recurrent layers (Gated DeltaNet, Kimi delta attention, Mamba-2) as
themselves, not as attention layers: the parameters one rank holds equal the real model's, on one process,
per pipeline stage and under tensor parallelism (the trainer's own plan applied on real gloo ranks); a
recurrent layer's forward FLOPs equal FlopCounterMode's count of its real chunked forward; under full
recomputation the stored activations equal the bytes autograd keeps. Without recomputation the planner
still lists an attention layer's saved tensors for a recurrent one (a strict xfail says by how much)."""

from __future__ import annotations

import pytest
import torch

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.plan.layout import Layout, stage_layers
from tessera.plan.memory import rank_params
from tests.forked_ranks import run_ranks

HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h", "tiny-qwen3.5-moe"]


@pytest.mark.parametrize("name", HYBRIDS)
def test_one_rank_holds_the_built_models_parameters(name):
    cfg = get_preset(name)
    (only,) = rank_params(cfg, Layout())
    assert only.total == sum(p.numel() for p in Transformer(cfg).parameters())


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_each_pipeline_stage_holds_its_layers_parameters(name):
    """Per stage against the real model's parameters of that stage's layers (and the ends' embedding, head)."""
    cfg = get_preset(name)
    model = Transformer(cfg)
    stages = stage_layers(cfg.n_layers, 2)
    for s, got in enumerate(rank_params(cfg, Layout(pp=2))):
        keep = tuple(f"layers.{i}." for i in stages[s]) + (("tok_embeddings",) if s == 0 else ("norm.", "output."))
        want = sum(p.numel() for n, p in model.named_parameters() if n.startswith(keep))
        assert got.total == want, (name, s)


def _local_parameters(name: str) -> int:
    """One rank's parameter elements after the trainer's tp=2 plan (DTensors: this rank's part)."""
    from tessera.parallel import parallelize
    from tessera.parallel.dims import ParallelDims

    cfg = get_preset(name)
    pcfg = ParallelConfig(tp=2, dp_shard=1)
    dims = ParallelDims.from_config(pcfg, 2)
    dims.validate(cfg, 2, seq_len=16)
    dims.build_mesh("cpu")
    model = parallelize(Transformer(cfg), dims, pcfg)
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h"])
def test_a_tensor_parallel_rank_holds_what_the_trainers_plan_leaves_it(name):
    """tp=2: heads and projections cut, the convolutions, gains and (Qwen3.5's in_proj_qkv, Mamba-2's in_proj)
    the tensors read through the mixers' `own_part` seams whole on every rank."""
    torch.manual_seed(0)
    got = run_ranks(_local_parameters, 2, name)
    (planned,) = rank_params(get_preset(name), Layout(tp=2))
    assert got[0] == got[1] == planned.total


def _counted_flops(mixer, x: torch.Tensor) -> float:
    """FLOPs torch's FlopCounterMode counts in one chunked forward of `mixer` with gradients on (as training
    runs it), in-place batched products included (the counter's registry covers only aten.baddbmm)."""
    from torch.utils.flop_counter import FlopCounterMode

    def in_place(self_shape, a_shape, b_shape, *_, out_shape=None, **__) -> int:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.baddbmm_: in_place}) as counter:
        mixer.mix(x.requires_grad_(), recurrent=False)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h"])
@pytest.mark.parametrize("seq", [40, 64, 96])
def test_a_recurrent_layers_forward_flops_are_its_chunked_forms(name, seq):
    """A recurrent layer's planned forward FLOPs (its projections and the chunked core, padding included)
    equal what FlopCounterMode counts in the real layer's chunked forward, at sequences of part, one and
    several chunks; an attention-shaped count (the layer's mixer as softmax attention) is not."""
    from tessera.models.flops import attention_matmul_params, layer_forward_flops_per_token, mlp_matmul_params

    cfg = get_preset(name)
    model = Transformer(cfg)
    i = next(i for i in range(cfg.n_layers) if cfg.is_linear_attention_layer(i) or cfg.is_mamba_layer(i))
    x = torch.randn(2, seq, cfg.dim, generator=torch.Generator().manual_seed(0))
    counted = _counted_flops(model.layers[str(i)].attention, x) / (2 * seq)
    planned = layer_forward_flops_per_token(cfg, i, seq) - 2.0 * mlp_matmul_params(cfg, i)
    assert planned == pytest.approx(counted, rel=1e-9)
    assert 2.0 * attention_matmul_params(cfg, None) != pytest.approx(counted, rel=0.05)


def _planned_and_counted(name: str, recompute: str, dtype: str) -> tuple[float, float]:
    """One micro-batch's stored activations on one rank (`stage_activations`) and the bytes autograd keeps
    in the real model's forward and loss under the trainer's recomputation (tests/plan/activation_measurement.py)."""
    from tessera.plan.activations import stage_activations
    from tessera.plan.layout import Workload
    from tests.plan.activation_measurement import measure_activation_bytes

    cfg = get_preset(name)
    counted = measure_activation_bytes(cfg, dtype, recompute, 2, 64).total_bytes
    (stage,) = stage_activations(cfg, Layout(recompute=recompute), Workload(seq_len=64, micro_batch=2, global_batch=2),
                                 dtype)
    return stage.stored, counted


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("dtype", ["fp32", "autocast-bf16"])
def test_full_recomputation_keeps_each_hybrid_layers_input(name, dtype):
    planned, counted = _planned_and_counted(name, "full", dtype)
    assert planned == pytest.approx(counted, rel=1e-3)


@pytest.mark.xfail(strict=True, reason="left: the planner lists an attention layer's saved tensors for a recurrent "
                   "layer too (activation_terms.py has no mirror of the chunked delta rule or SSD): without "
                   "recomputation it plans 0.48x (Qwen3.5) to 1.34x (Nemotron-H) of the bytes the tiny models keep")
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_a_recurrent_layers_saved_tensors_without_recomputation(name):
    planned, counted = _planned_and_counted(name, "none", "fp32")
    assert planned == pytest.approx(counted, rel=1e-3)

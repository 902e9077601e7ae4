"""The planner sizes a hybrid model's recurrent layers (Gated DeltaNet, Kimi delta attention, Mamba-2) as
themselves, not as attention layers: the parameters one rank holds equal the real model's, on one process,
per pipeline stage and under tensor parallelism (the trainer's own plan applied on real gloo ranks); a
recurrent layer's forward FLOPs equal FlopCounterMode's count of its real chunked forward; under full
recomputation the stored activations equal the bytes autograd keeps, and without it a recurrent layer's
saved tensors (its chunked form's, slab by slab) do too, as does the whole model without, with selective
and with operator-level recomputation (a recurrent mixer's projections kept by role, its core re-run;
Kimi Linear's latent attention, whose value head is narrower than its query/key head, through the CPU
SDPA's math kernel: the planner asked for device cpu, as these measurements run); the op policy's
recomputed FLOPs and time count the recurrent cores. Nemotron-H's MoE variant (relu^2 routed and shared
experts: up and down) is planned as itself too, and under operator-level recomputation its products (and
gpt-oss's) keep their outputs by role, grouped or one per expert, on one process and on ep ranks. The
activations are measured fp32, bf16 (a bf16 model) and under autocast (the trainer's train.dtype: bf16)."""

from __future__ import annotations

import pytest
import torch

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.models import Transformer
from tessera.plan.layout import Layout, Workload, stage_layers
from tessera.plan.memory import rank_params
from tests.forked_ranks import run_ranks

HYBRIDS = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h", "tiny-qwen3.5-moe"]
WITH_RELU2_MOE = [*HYBRIDS, "tiny-nemotron-h-moe"]  # Nemotron-H's MoE variant: relu^2 routed and shared experts
DTYPES = ["fp32", "bf16", "autocast-bf16"]  # bf16: parameters and activations bf16; autocast-bf16: the trainer's


@pytest.mark.parametrize("name", WITH_RELU2_MOE)
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
    from tests.plan.activation_measurement import measure_activation_bytes

    cfg = get_preset(name)
    counted = measure_activation_bytes(cfg, dtype, recompute, 2, 64).total_bytes
    (stage,) = stage_activations(cfg, Layout(recompute=recompute, device="cpu"),
                                 Workload(seq_len=64, micro_batch=2, global_batch=2), dtype)
    return stage.stored, counted


@pytest.mark.parametrize("name", WITH_RELU2_MOE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_recomputation_keeps_each_hybrid_layers_input(name, dtype):
    planned, counted = _planned_and_counted(name, "full", dtype)
    assert planned == pytest.approx(counted, rel=1e-3)


def _block_saved_bytes(cfg, layer: int, dtype: str, batch: int, seq: int) -> tuple[float, int]:
    """(planned, counted): layer `layer`'s saved tensors as `layer_saved_tensors` lists them, and the bytes
    autograd keeps in the real block's training forward from a leaf input (no recomputation)."""
    from tessera.plan.saved.activation_terms import layer_saved_tensors
    from tessera.plan.saved_tensors import SavedTensorCounter

    torch.manual_seed(0)
    block = Transformer(cfg).layers[str(layer)]
    x = torch.randn(batch, seq, cfg.dim, requires_grad=True)
    if dtype == "bf16":  # parameters and activations in bf16 (activation_dtypes.py)
        block, x = block.to(torch.bfloat16), x.detach().to(torch.bfloat16).requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast-bf16")
    with SavedTensorCounter(block) as counter, autocast:
        out, _ = block(x, None, None)  # a recurrent mixer reads no RoPE tables
    out.float().sum().backward()  # the graph is whole
    terms = layer_saved_tensors(cfg, layer, dtype, tokens=batch * seq, batch=batch)
    return sum(t.nbytes(batch * seq) for t in terms), counter.total_bytes


def _first_recurrent_layer(cfg) -> int:
    return next(i for i in range(cfg.n_layers) if cfg.is_linear_attention_layer(i) or cfg.is_mamba_layer(i))


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seq", [(2, 64), (2, 40), (1, 96)])
def test_a_recurrent_layers_saved_tensors_are_what_autograd_keeps(name, dtype, batch, seq):
    """Without recomputation a recurrent layer's planned saved tensors (Gated DeltaNet, Kimi delta attention,
    Mamba-2: recurrent_terms.py) equal what autograd keeps in its chunked forward, at whole chunks, one
    short chunk and a sequence padded to whole chunks, fp32, bf16 and under autocast; they were an attention
    layer's (0.48x-1.34x of the tiny models' bytes). In bf16 the forms' products run in fp32 (not in bf16 as
    under autocast) and Gated DeltaNet's gated norm keeps its gained value in bf16 (a
    Mamba-2 layer was planned 0.92x, a Gated DeltaNet layer 1.01x of its bytes)."""
    cfg = get_preset(name)
    planned, counted = _block_saved_bytes(cfg, _first_recurrent_layer(cfg), dtype, batch, seq)
    assert planned == counted


def _variant(name: str):
    """A tiny hybrid whose recurrent layer's value and key sizes differ, with one value head per key head
    (Gated DeltaNet) and short chunks, so that a sequence spans several chunks and slabs."""
    import dataclasses

    cfg = get_preset(name)
    if cfg.mamba is not None:
        return dataclasses.replace(cfg, mamba=dataclasses.replace(cfg.mamba, chunk_size=8, head_dim=4))
    la = cfg.linear_attention
    heads = la.n_value_heads if la.kind == "gated_deltanet" else la.n_key_heads
    return dataclasses.replace(cfg, linear_attention=dataclasses.replace(
        la, chunk_size=16, n_key_heads=heads, value_head_dim=la.value_head_dim // (2 if la.kind != "kda" else 1)))


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slab", [1, 3])
def test_saved_tensors_follow_the_forms_slabs_of_chunks(name, dtype, slab, monkeypatch):
    """The forms compute a slab of chunks' terms at once (one chunk a slab in a real model's layer): with the
    slab bound shrunk to `slab` chunks in the layer and in the planner alike, a padded sequence of several
    slabs still plans to the byte."""
    import tessera.models.linear_attention.delta_rule as delta_rule
    import tessera.models.linear_attention.ssd as ssd
    import tessera.plan.saved.recurrent_terms as terms

    cfg = _variant(name)
    B, seq = 2, 40
    if cfg.mamba is not None:
        m = cfg.mamba
        bound = slab * B * m.n_heads * m.chunk_size * max(m.chunk_size, m.head_dim * m.state_size // m.chunk_size)
        monkeypatch.setattr(ssd, "SLAB_TERMS", bound)
        monkeypatch.setattr(terms, "SSD_SLAB_TERMS", bound)
    else:
        la = cfg.linear_attention
        per_chunk = B * la.n_value_heads * 16 * (8 * la.key_head_dim if la.kind == "kda" else
                                                  la.key_head_dim + la.value_head_dim)
        for module, prefix in ((delta_rule, ""), (terms, "DELTA_RULE_")):
            monkeypatch.setattr(module, f"{prefix}PER_HEAD_TERMS", slab * per_chunk)
            monkeypatch.setattr(module, f"{prefix}PER_CHANNEL_TERMS", slab * per_chunk)
    planned, counted = _block_saved_bytes(cfg, _first_recurrent_layer(cfg), dtype, B, seq)
    assert planned == counted


@pytest.mark.parametrize("name", WITH_RELU2_MOE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recompute", ["none", "selective", "op"])
def test_a_hybrid_models_stored_activations_without_full_recomputation(name, dtype, recompute):
    """The whole model (the recurrent layers, the gated attention layers, Kimi Linear's latent attention
    without RoPE, whose value head is narrower than its query/key head so that the CPU's SDPA runs its math
    kernel, Nemotron-H's one-sublayer layers and relu^2 MLPs, no RoPE tables where no layer rotates) without
    recomputation, with selective recomputation (which re-runs attention cores only) and with operator-level
    recomputation under torchtitan's save list (the layer's input and every other product's output; a
    recurrent mixer's chunked core re-runs, its products not among them) equals the bytes autograd keeps."""
    planned, counted = _planned_and_counted(name, recompute, dtype)
    assert planned == pytest.approx(counted, rel=1e-9)


@pytest.mark.parametrize("name", WITH_RELU2_MOE)
@pytest.mark.parametrize("save,fp8", [(("matmuls",), ()), (("attention_in", "mlp_out"), ()),
                                      (("attention_out",), ("attention_in",)), (("attention_core",), ())])
def test_the_op_policys_kept_outputs_of_a_hybrid_model(name, save, fp8):
    """recompute=op with other save lists: a recurrent mixer's projections keep their outputs by role
    (those into the mixer attention_in, its output projection attention_out; in FP8 at one byte and an fp32
    scale per row), its core keeps nothing even where attention_core is saved; the planned bytes
    (saved/recompute_terms.py) equal what the trainer's policy keeps in the real model (fp32)."""
    from tessera.plan.activations import stage_activations
    from tests.plan.activation_measurement import measure_activation_bytes

    cfg = get_preset(name)
    counted = measure_activation_bytes(cfg, "fp32", "op", 2, 64, save=save, fp8=fp8).total_bytes
    lay = Layout(recompute="op", recompute_save=save, activation_fp8=fp8, device="cpu")
    (stage,) = stage_activations(cfg, lay, Workload(seq_len=64, micro_batch=2, global_batch=2), "fp32")
    assert stage.stored == pytest.approx(counted, rel=1e-9)


def _kept_by_op_policy(name: str, save: tuple[str, ...]) -> int:
    """Bytes the op policy's caches keep in one forward of the model under the trainer's tp=2 plan on this rank."""
    from tessera.parallel import parallelize
    from tessera.parallel.dims import ParallelDims

    cfg = get_preset(name)
    pcfg = ParallelConfig(tp=2, dp_shard=1, recompute="op", recompute_save=save)
    dims = ParallelDims.from_config(pcfg, 2)
    dims.validate(cfg, 2, seq_len=16)
    dims.build_mesh("cpu")
    model = parallelize(Transformer(cfg), dims, pcfg)
    kept: dict[int, int] = {}

    def observe(t: torch.Tensor) -> None:
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # a DTensor: this rank's part
        kept[storage.data_ptr()] = storage.nbytes()

    for policy in (m.recompute_policy for m in model.modules() if hasattr(m, "recompute_policy")):
        policy.observers.append(observe)
    model(torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)))
    return sum(kept.values())


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-nemotron-h"])
def test_a_tensor_parallel_rank_keeps_the_recurrent_projections_its_save_list_names(name):
    """Under tp=2 Qwen3.5's in_proj_qkv and Mamba-2's in_proj run outside their modules (F.linear of what the
    `own_part` seam reads): the policy still gives them their role, so each rank keeps its part of every
    attention_in output, as the planner's op terms (less the layer inputs) cut by tp say."""
    from tessera.plan.saved.activation_terms import layer_saved_tensors

    torch.manual_seed(0)
    save = ("attention_in",)
    got = run_ranks(_kept_by_op_policy, 2, name, save)
    cfg = get_preset(name)
    planned = sum(t.nbytes(32, tp=2) for i in range(cfg.n_layers) for t in layer_saved_tensors(
        cfg, i, "fp32", recompute="op", tokens=32, batch=2, save=save) if t.name != "layer.input")
    assert got[0] == got[1] == planned


LARGE = ["qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "nemotron-h-8b"]


@pytest.mark.parametrize("name", LARGE)
def test_the_op_policy_re_runs_a_recurrent_core_whatever_it_keeps(name):
    """With every product and the attention core kept, what recompute=op still re-runs is the recurrent
    mixers' chunked cores: its recomputed FLOPs are theirs (models/flops.py), and a recurrent layer's
    recomputed time is its core's (no product again, no attention core)."""
    from tessera.models.flops import delta_rule_flops_per_token, ssd_flops_per_token
    from tessera.plan.cluster import Cluster
    from tessera.plan.estimate import recompute_flops
    from tessera.plan.op_time import layer_ops, layer_time, recompute_time

    cfg, seq = get_preset(name), 4096
    lay = Layout(dp_shard=8, recompute="op", recompute_save=("matmuls", "attention_core"))
    work = Workload(seq_len=seq, micro_batch=1, global_batch=8)
    recurrent = [i for i in range(cfg.n_layers) if cfg.is_linear_attention_layer(i) or cfg.is_mamba_layer(i)]
    core = delta_rule_flops_per_token(cfg, seq) if cfg.linear_attention is not None else ssd_flops_per_token(cfg, seq)
    assert recompute_flops(cfg, lay, work, "autocast-bf16") == pytest.approx(len(recurrent) * core)
    c, i = Cluster.for_gpu("h100", gpus=8), recurrent[0]
    forward = layer_time(cfg, cfg.is_moe_layer(i), lay, seq, seq, c, "autocast-bf16", layer=i)
    again = recompute_time(cfg, cfg.is_moe_layer(i), lay, seq, seq, c, "autocast-bf16", forward, i)
    (core_op,) = [o for o in layer_ops(cfg, cfg.is_moe_layer(i), lay, seq, seq, c, "autocast-bf16", layer=i)
                  if o.name.endswith(" core")]
    assert (again.matmul, again.attention) == (pytest.approx(core_op.seconds), 0.0)


@pytest.mark.parametrize("name", LARGE)
@pytest.mark.parametrize("tp", [1, 2])
def test_a_recurrent_layers_time_is_its_own_operators(name, tp):
    """The time model prices a recurrent layer's own products: its projections (its own weights) and its
    chunked core at the FLOPs models/flops.py counts (equal to FlopCounterMode above), no attention core;
    the layer's time is the sum of its printed operators and its products' FLOPs are the layer's forward
    FLOPs (what MFU counts), cut by tp."""
    from tessera.models.flops import (
        attention_matmul_params,
        delta_rule_flops_per_token,
        layer_forward_flops_per_token,
        ssd_flops_per_token,
    )
    from tessera.plan.cluster import Cluster
    from tessera.plan.op_time import layer_ops, layer_time

    cfg, c, seq = get_preset(name), Cluster.for_gpu("h100", gpus=8), 4096
    lay = Layout(tp=tp, dp_shard=8 // tp)
    i = _first_recurrent_layer(cfg)
    ops = layer_ops(cfg, cfg.is_moe_layer(i), lay, 2 * seq, seq, c, layer=i)
    assert layer_time(cfg, cfg.is_moe_layer(i), lay, 2 * seq, seq, c, layer=i).forward == pytest.approx(
        sum(o.seconds for o in ops))
    assert {o.kind for o in ops} == {"matmul", "memory"}
    (core,) = [o for o in ops if o.name.endswith(" core")]
    per_token = delta_rule_flops_per_token(cfg, seq) if cfg.is_linear_attention_layer(i) else ssd_flops_per_token(
        cfg, seq)
    assert core.flops == pytest.approx(per_token * 2 * seq / tp)
    mixer = sum(o.flops for o in ops if o.name.startswith(core.name.removesuffix(" core")))
    assert mixer == pytest.approx((2 * attention_matmul_params(cfg, i) + per_token) * 2 * seq / tp)
    if tp == 1:  # (the router's product is not cut by tp)
        matmul = sum(o.flops for o in ops if o.kind == "matmul")
        assert matmul == pytest.approx(layer_forward_flops_per_token(cfg, i, seq) * 2 * seq, rel=0.01)


@pytest.mark.parametrize("name", LARGE)
def test_a_recurrent_cores_time_per_token_does_not_grow_with_the_sequence(name):
    """The chunked core's work per token is fixed by the chunk, so its time per token at 32k tokens is
    that at 4k, where an attention core's grows with the keys each query reads (as the time model priced
    the recurrent layers before)."""
    from tessera.plan.cluster import Cluster
    from tessera.plan.op_time import layer_ops

    cfg, c = get_preset(name), Cluster.for_gpu("h100", gpus=8)
    i = _first_recurrent_layer(cfg)

    def core_per_token(seq: int, layer: int | None) -> float:
        ops = layer_ops(cfg, cfg.is_moe_layer(i), Layout(dp_shard=8), seq, seq, c, layer=layer)
        return sum(o.seconds for o in ops if "core" in o.name) / seq

    assert core_per_token(32768, i) == pytest.approx(core_per_token(4096, i), rel=0.05)
    assert core_per_token(32768, None) > 3 * core_per_token(4096, None)


@pytest.mark.parametrize("name,recompute", [("nemotron-h-8b", "none"), ("qwen3-next-80b-a3b", "full"),
                                            ("kimi-linear-48b-a3b", "selective")])
def test_a_hybrid_stages_compute_time_is_its_layers_own(name, recompute):
    """A stage's compute time sums each layer as itself (forward, input and weight gradients; the fused
    attention core's backward at 2.5 forwards; full recomputation one forward more, selective the
    attention core): Nemotron-H's Mamba-2, MLP and attention sublayers, a DeltaNet layer and its MoE."""
    from tessera.plan.cluster import Cluster
    from tessera.plan.op_time import FUSED_ATTENTION_BACKWARD, head_time, layer_time, stage_compute_time
    from tessera.plan.profile import ModelProfile

    cfg, c = get_preset(name), Cluster.for_gpu("h100", gpus=8)
    lay, work = Layout(dp_shard=8, recompute=recompute), Workload(seq_len=4096, micro_batch=1, global_batch=8)
    got = stage_compute_time(cfg, lay, work, 0, c, ModelProfile.of(cfg, work.seq_len))
    want = 3 * head_time(cfg, lay, 4096, c)
    for i in range(cfg.n_layers):
        t = layer_time(cfg, cfg.is_moe_layer(i), lay, 4096, 4096, c, layer=i)
        again = {"none": 0.0, "full": t.forward, "selective": t.attention}[recompute]
        want += 3 * (t.matmul + t.memory) + (1 + FUSED_ATTENTION_BACKWARD) * t.attention + again
    assert got.total == pytest.approx(want)


def _moe_variant(name: str, grouped: bool):
    """The preset with its routed experts as one grouped product per weight, or one product per expert (the loop)."""
    import dataclasses

    cfg = get_preset(name)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, grouped_gemm=grouped))


def _kept_relu2_products(save: tuple[str, ...], grouped: bool, parallel: dict | None = None) -> tuple[int, bool, bool]:
    """(outputs kept, whether the routed ones are the experts' products the save list names, whether the last is the
    shared expert's) of tiny-nemotron-h-moe's first MoE layer under recompute=op, on one process or on this rank of
    `parallel` (the trainer's plan: under ep its experts, the rows it received)."""
    from tessera.models.moe.experts import grouped_linear
    from tessera.parallel import parallelize
    from tessera.parallel.dims import ParallelDims
    from tessera.parallel.memory.activation_checkpoint import apply_activation_checkpointing

    cfg = _moe_variant("tiny-nemotron-h-moe", grouped)
    model = Transformer(cfg, init_seed=0)
    if parallel is None:
        apply_activation_checkpointing(model, "op", 1, save=save)
    else:
        pcfg = ParallelConfig(**parallel, recompute="op", recompute_save=save)
        dims = ParallelDims.from_config(pcfg, 2)
        dims.validate(cfg, 2, seq_len=16)
        dims.build_mesh("cpu")
        model = parallelize(model, dims, pcfg)
    moe, kept, seen = model.layers["1"].moe, [], {}
    model.layers["1"].recompute_policy.observers.append(kept.append)
    moe.experts.register_forward_hook(lambda m, args, out: seen.update(rows=args, down=out))
    for name in ("w1", "w2"):
        getattr(moe.shared_experts, name).register_forward_hook(lambda m, a, out, name=name: seen.update({name: out}))
    model(torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)))
    rows, tokens_per_expert = seen["rows"]
    up = save == ("mlp_in",)
    routed = grouped_linear(rows, moe.experts.local_weight(moe.experts.w1), tokens_per_expert, grouped) if up \
        else seen["down"]
    return len(kept), torch.equal(torch.cat(kept[:-1]), routed), torch.equal(kept[-1], seen["w1" if up else "w2"])


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("save", [("mlp_in",), ("mlp_out",)])
def test_the_op_policy_keeps_the_relu2_expert_products_its_save_list_names(grouped, save):
    """A relu^2 MoE layer (Nemotron-H's) under recompute=op keeps, of its products, exactly the outputs of the
    role saved: mlp_in the routed experts' up product (every expert's, in the loop) and the shared expert's w1,
    mlp_out their down products; the relu^2 experts were not scoped at all (and their roles, by position, were
    SwiGLU's: gate and up the first two products)."""
    experts = 1 if grouped else get_preset("tiny-nemotron-h-moe").moe.num_experts
    assert _kept_relu2_products(save, grouped) == (experts + 1, True, True)


@pytest.mark.dist
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("save", [("mlp_in",), ("mlp_out",)])
def test_an_expert_parallel_rank_keeps_the_relu2_products_of_its_experts(grouped, save):
    """Under ep=2 (with fsdp) each rank keeps its own experts' products of the role saved, on the rows it
    received: one grouped product per weight, or one per local expert in the loop."""
    experts = 1 if grouped else get_preset("tiny-nemotron-h-moe").moe.num_experts // 2
    got = run_ranks(_kept_relu2_products, 2, save, grouped, dict(ep=2, dp_shard=2))
    assert got[0] == got[1] == (experts + 1, True, True)


@pytest.mark.parametrize("name,grouped,save,fp8", [
    *((name, grouped, save, fp8) for name in ("tiny-nemotron-h-moe", "tiny-gpt-oss") for grouped in (True, False)
      for save, fp8 in ((("mlp_in",), ()), (("mlp_out",), ()), (("mlp_in", "mlp_out", "router"), ()),
                        (("mlp_out",), ("mlp_in",)))),
    ("tiny-nemotron-h-moe", True, ("alternate_matmuls",), ()), ("tiny-gpt-oss", True, ("alternate_matmuls",), ()),
    ("tiny-gpt-oss", True, ("attention_core", "mlp_in"), ())])
def test_the_planned_op_bytes_of_routed_experts_are_what_the_policy_keeps(name, grouped, save, fp8):
    """Routed experts under recompute=op, their products listed by their activation: Nemotron-H's relu^2 experts
    and shared expert (up, down; they were SwiGLU's three) and gpt-oss's biased experts (gate_up, down; not
    scoped before), kept whole or in FP8; gpt-oss's attention core with sinks keeps nothing even where attention_core
    is saved (saved_terms.py's `sdpa_core`). The planned bytes equal what the policy keeps (fp32). (Only with the
    grouped product under alternate_matmuls: in the loop, which experts' products it keeps follows the
    routing; the planner's rows are balanced.)"""
    from tessera.plan.activations import stage_activations
    from tests.plan.activation_measurement import measure_activation_bytes

    cfg = _moe_variant(name, grouped)
    counted = measure_activation_bytes(cfg, "fp32", "op", 2, 64, save=save, fp8=fp8).total_bytes
    lay = Layout(recompute="op", recompute_save=save, activation_fp8=fp8, device="cpu")
    (stage,) = stage_activations(cfg, lay, Workload(seq_len=64, micro_batch=2, global_batch=2), "fp32")
    assert stage.stored == pytest.approx(counted, rel=1e-9)


def test_a_relu2_moe_layers_products_are_its_forward_flops():
    """The time model prices Nemotron-H's MoE layer by its own products: the router, the relu^2 routed and shared
    experts' up and down (they were SwiGLU's gate+up and down: 1.49x the layer's FLOPs), whose FLOPs are the
    layer's forward FLOPs (models/flops.py, what MFU counts)."""
    from tessera.models.flops import layer_forward_flops_per_token
    from tessera.plan.cluster import Cluster
    from tessera.plan.op_time import layer_ops

    cfg, c, seq = get_preset("tiny-nemotron-h-moe"), Cluster.for_gpu("h100", gpus=8), 4096
    (i, *_) = cfg.moe_layers
    ops = layer_ops(cfg, True, Layout(dp_shard=8), 2 * seq, seq, c, layer=i)
    assert [o.name for o in ops if o.kind == "matmul"] == ["router", "experts (grouped, 4 local) up",
                                                           "experts (grouped, 4 local) down", "shared expert up",
                                                           "shared expert down"]
    matmul = sum(o.flops for o in ops if o.kind == "matmul")
    assert matmul == pytest.approx(layer_forward_flops_per_token(cfg, i, seq) * 2 * seq)

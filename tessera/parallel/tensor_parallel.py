"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models") as a plan: a dict from
submodule name to a DTensor parallel style, so one glance shows how a block is cut.

    attention.wq / wk / wv      colwise   heads split over tp (each rank: H/tp query, G/tp kv heads)
    attention.wo                rowwise   partial sums reduced (all-reduce, or reduce-scatter under sp)
    MLA: attention.wq or wq_b,  colwise   heads split (the up-projections from the latents)
         attention.wkv_b
         attention.wo           rowwise
         wq_a, q_norm, wkv_a,   replicated: the low-rank down-projections and their norms are shared
         kv_norm                by all heads; the colwise inputs' backward sums their gradient over
                                tp, and the shared RoPE key's gradient is summed over tp by the seam
                                `share_rope_key` (each rank's heads use it: `SumOverRanksHeads`)
         indexer.*              replicated (DeepSeek-V3.2): every rank scores the same keys; the
                                indexer loss's target sums all ranks' heads (`HeadSumOverRanks`)
    Gated DeltaNet (hybrid      key-head groups split: in_proj_qkvz, in_proj_ba colwise (HuggingFace's
      layers): attention.*      per-group layout makes a rank's groups contiguous), out_proj rowwise;
                                the conv taps of this rank's q, k, v channels, its heads' A_log and
                                dt_bias, and the shared gated-norm weight are sliced from replicated
                                tensors by the layer's `own_part` seam, their gradient summed over tp
                                (`DeltaNetRankPart`). Qwen3.5's split layout: in_proj_z, in_proj_b,
                                in_proj_a colwise (by value heads); in_proj_qkv replicated, this rank's
                                q, k, v rows read through the seam as the conv's channels are
    Mamba-2 (Nemotron-H's      heads split with their groups: out_proj rowwise; in_proj (rows
      mixers): attention.*      [z | x B C | dt]), the conv taps and bias, dt_bias, A_log, D and the
                                norm's gains stay replicated, this rank's rows, channels and heads
                                read through the mixer's `own_part` seam, their gradient (and the
                                input's) summed over tp (`MambaRankPart`); serving cuts these
                                whole tensors to the rank's part at load (each part's `cut`)
    one-sublayer layers         the one sublayer's plan (`SublayerBlock`, Nemotron-H; an MoE one's as a block's MoE)
    feed_forward.w1 / w3        colwise   SwiGLU hidden dim split (relu^2's ungated w1 alike)
    feed_forward.w2             rowwise
    moe.shared_experts.*        same as feed_forward; routed experts: see expert_parallel.py
    tok_embeddings              rowwise on the vocabulary (vocab-parallel embedding)
    output                      colwise on the vocabulary; logits stay a DTensor sharded on V, and
                                `vocab_parallel_loss_sum` never gathers them
    tied head (tie_embeddings)  the embedding's own vocabulary shard, one DTensor weight for both
                                (`VocabParallelTiedHead`, the model's `tied_head` seam)
    attention.sinks             by heads (gpt-oss's sink logits, with the heads they belong to)
    *_norm, norm                replicated; under sp they run on a 1/tp slice of the sequence
    mtp.{k}.block               the block's plan (multi-token prediction, models/mtp.py)
    mtp.{k}.enorm / hnorm /     replicated; under sp the norms run on the sequence slice and
      eh_proj / norm            eh_proj gathers the sequence and returns this rank's slice; the
                                modules' cross-entropy is the vocabulary-parallel one (the model's
                                `token_loss` seam)

A layer that carries a LoRA adapter (train.lora, tessera.models.lora) is cut with its adapter: in a
colwise layer B [out, r] by rows as the weight (each rank adds its own outputs' part), A whole; in a
rowwise layer A [r, in] by columns as the weight (A x is a partial sum, B of it too, reduced with the
layer's own output), B whole (`Colwise`, `Rowwise`). The rank is never cut. The replicated factor's
gradient would be a partial sum on each rank; the adapter's seam `lora_delta` is filled with a product
that makes it whole (`colwise_adapter_delta`, `rowwise_adapter_delta`: one all-reduce of [tokens, r]).
SequenceParallel makes its parameters anew, requiring gradients: a frozen one (a LoRA run's norms)
is frozen again after the plans are applied.

Under sp the residual stream between sublayers is a local [B, S/tp, D] tensor; attention, MLP and
MoE gather the sequence on entry and reduce-scatter on exit. Without sp it is a replicated
[B, S, D] tensor. Every rank keeps the full sequence for RoPE (positions are global).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
from tessera.models.linear_attention.mamba2 import Mamba2Mixer
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.sublayer_block import SublayerBlock
from tessera.parallel.collectives import copy_to_group
from tessera.parallel.vocab_parallel_loss import vocab_parallel_loss_sum


def colwise_adapter_delta(module: nn.Module, x: DTensor) -> DTensor:
    """The `lora_delta` seam of a column-parallel layer: s * B (A x), B cut by rows. A x is replicated and
    each rank's B rows give its part of its gradient: DTensor.from_local's backward sums it over tp
    (an all-reduce of [tokens, r]), so the replicated A's gradient is whole on every rank."""
    h = module.lora_A(module.lora_dropout(x))
    h = DTensor.from_local(h.to_local(), h.device_mesh, h.placements, run_check=False)
    return module.lora_B(h) * module.lora_scaling


def rowwise_adapter_delta(module: nn.Module, x: DTensor) -> DTensor:
    """The `lora_delta` seam of a row-parallel layer: s * B (A x), A cut by columns. A x is a partial sum,
    made whole (an all-reduce of [tokens, r]) so that the replicated B's gradient is whole on every rank;
    B of it, replicated, joins the layer's partial output as a 1/tp share on each rank (DTensor's add),
    reduced with it."""
    h = module.lora_A(module.lora_dropout(x)).redistribute(placements=[Replicate()])
    return module.lora_B(h) * module.lora_scaling


class Colwise(ColwiseParallel):
    """ColwiseParallel that cuts a layer's LoRA adapter with it (module docstring): B by rows, A
    replicated (distribute_module replicates what is left), and fills its `lora_delta` seam."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if hasattr(module, "lora_delta"):
            module.lora_delta = colwise_adapter_delta
        return super()._apply(module, device_mesh)

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "lora_B" or name == "":  # the layer's own weight and bias, or B: by output rows
            for key, p in list(module._parameters.items()):
                if p is not None:
                    module.register_parameter(key, nn.Parameter(distribute_tensor(
                        p, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank), requires_grad=p.requires_grad))


class Rowwise(RowwiseParallel):
    """RowwiseParallel that cuts a layer's LoRA adapter with it (module docstring): A by input
    columns, B replicated, and fills its `lora_delta` seam."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if hasattr(module, "lora_delta"):
            module.lora_delta = rowwise_adapter_delta
        return super()._apply(module, device_mesh)

    def _partition_linear_fn(self, name, module, device_mesh):
        if name == "lora_A":
            p = module.weight
            module.register_parameter("weight", nn.Parameter(distribute_tensor(
                p, device_mesh, [Shard(1)], src_data_rank=self.src_data_rank), requires_grad=p.requires_grad))
        elif name == "":
            super()._partition_linear_fn(name, module, device_mesh)


class HeadSharded(ParallelStyle):
    """A parameter with one entry per query head (gpt-oss's attention sinks) cut with the heads, as
    the colwise q projection cuts them: Shard(0) over tp, each rank cutting its own piece."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for key, p in list(module._parameters.items()):
            sharded = distribute_tensor(p, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(sharded, requires_grad=p.requires_grad))
        return module


def _gather_sequence_on_entry(num_inputs: int) -> PrepareModuleInput:
    """Under sp: the first input arrives sharded on the sequence; the module wants it whole."""
    rest = (None,) * (num_inputs - 1)
    return PrepareModuleInput(input_layouts=(Shard(1),) + rest, desired_input_layouts=(Replicate(),) + rest,
                              use_local_output=True)


def _moe_on_the_whole_sequence() -> PrepareModuleInputOutput:
    """Under sp: the MoE block routes the whole micro-batch on every tp rank; its output (replicated)
    is cut back to this rank's sequence slice, and (y, router output) is a tuple."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None), use_local_output=True)


def sublayer_plan(block: SublayerBlock, sp: bool) -> dict[str, ParallelStyle]:
    """The plan of a one-sublayer layer (Nemotron-H): its Mamba-2 mixer, attention, MLP or MoE layer (its
    shared expert cut as an MLP, its routed experts' hidden dims by expert_parallel.py, as a block's)."""
    stream = Shard(1) if sp else Replicate()
    if hasattr(block, "moe"):
        plan = {} if block.moe.shared_experts is None else {
            "moe.shared_experts.w1": Colwise(), "moe.shared_experts.w2": Rowwise(output_layouts=Replicate())}
        return plan | ({"ffn_norm": SequenceParallel(), "moe": _moe_on_the_whole_sequence()} if sp else {})
    if hasattr(block, "feed_forward"):
        plan = {"feed_forward.w1": Colwise(), "feed_forward.w2": Rowwise(output_layouts=stream)}
        return plan | ({"ffn_norm": SequenceParallel(), "feed_forward": _gather_sequence_on_entry(1)} if sp else {})
    if isinstance(block.attention, Mamba2Mixer):
        plan = {"attention.out_proj": Rowwise(output_layouts=stream)}
    else:
        plan = {f"attention.{n}": Colwise() for n in ("wq", "wk", "wv")}
        plan["attention.wo"] = Rowwise(output_layouts=stream)
    return plan | ({"attention_norm": SequenceParallel(), "attention": _gather_sequence_on_entry(4)} if sp else {})


def block_plan(block: nn.Module, sp: bool) -> dict[str, ParallelStyle]:
    """The plan of one TransformerBlock (dense or MoE), names relative to the block."""
    if isinstance(block, SublayerBlock):
        return sublayer_plan(block, sp)
    stream = Shard(1) if sp else Replicate()  # layout of the residual stream
    mla = isinstance(block.attention, MultiHeadLatentAttention)
    deltanet = isinstance(block.attention, (GatedDeltaNet, KimiDeltaAttention))
    plan: dict[str, ParallelStyle] = _mla_plan(block.attention, stream) if mla else _deltanet_plan(
        block.attention, stream) if deltanet else {
        "attention.wq": Colwise(),
        "attention.wk": Colwise(),
        "attention.wv": Colwise(),
        "attention.wo": Rowwise(output_layouts=stream),
    }
    if not mla and not deltanet and block.attention.sinks is not None:
        plan["attention.sinks"] = HeadSharded()  # this rank's heads' sink logits (AttentionSinks.local)
    if not mla and not deltanet and block.attention.q_norm is not None:
        # QK-norm weights are shared by all heads but each rank sees H/tp heads: treating the head
        # dim as sharded makes DTensor sum their gradient over tp.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sp:  # every RMSNorm of the stream the block has: before and / or after attention and MLP
        for norm in ("attention_norm", "ffn_norm"):
            if getattr(block, norm) is not None:
                plan[norm] = SequenceParallel()
        for norm in ("attention_post_norm", "ffn_post_norm"):  # their output joins the (local) residual stream
            if getattr(block, norm) is not None:
                plan[norm] = SequenceParallel(use_local_output=True)
        plan["attention"] = _gather_sequence_on_entry(4)  # (x, cos, sin, cache)
    if hasattr(block, "moe"):
        if sp:
            plan["moe"] = _moe_on_the_whole_sequence()
        if block.moe.shared_experts is not None:
            plan["moe.shared_experts.w1"] = Colwise()
            plan["moe.shared_experts.w3"] = Colwise()
            plan["moe.shared_experts.w2"] = Rowwise(output_layouts=Replicate())
    else:
        if sp:
            plan["feed_forward"] = _gather_sequence_on_entry(1)
        plan["feed_forward.w1"] = Colwise()
        plan["feed_forward.w3"] = Colwise()
        plan["feed_forward.w2"] = Rowwise(output_layouts=stream)
    return plan


def _deltanet_plan(attention: GatedDeltaNet, stream: Placement) -> dict[str, ParallelStyle]:
    """Gated DeltaNet: its projections cut by key-head groups (grouped layout) or value heads (split
    layout: in_proj_qkv stays whole, read by this rank's rows through `DeltaNetRankPart`); Kimi delta
    attention's by heads (its module docstring)."""
    if isinstance(attention, KimiDeltaAttention):
        cut = ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj")
        return {f"attention.{n}": Colwise() for n in cut} | {"attention.o_proj": Rowwise(output_layouts=stream)}
    cut = ("in_proj_z", "in_proj_b", "in_proj_a") if attention.split else ("in_proj_qkvz", "in_proj_ba")
    return {f"attention.{n}": Colwise() for n in cut} | {"attention.out_proj": Rowwise(output_layouts=stream)}


def _mla_plan(attention: MultiHeadLatentAttention, stream: Placement) -> dict[str, ParallelStyle]:
    """Multi-head latent attention: the per-head up-projections split by heads, the shared
    down-projections (and their norms) left replicated."""
    q_up = "attention.wq" if hasattr(attention, "wq") else "attention.wq_b"
    return {q_up: Colwise(), "attention.wkv_b": Colwise(),
            "attention.wo": Rowwise(output_layouts=stream)}


class SumOverRanksHeads:
    """MLA's `share_rope_key` under tp: forward the identity, backward the sum of the gradient
    over the tp group (Megatron-LM's "f", `copy_to_group`). Every rank's heads use the one
    decoupled RoPE key, so each rank's gradient of it is partial; the sum makes the gradient of
    the replicated `wkv_a` exact on every rank."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    def __call__(self, k_rope_BSR: torch.Tensor) -> torch.Tensor:
        return copy_to_group(k_rope_BSR, self.group)


class HeadSumOverRanks:
    """Sparse attention's `head_sum` under tp (attention_variants/indexer_loss.py): the indexer loss's
    target sums the main attention's weights over every head, each rank holding H/tp of them, so the
    rank's sum is all-reduced over the tp group (no gradient: the target is a constant of the loss).
    The indexer itself is replicated and scores the same inputs on every rank, so with the whole target
    its gradient is whole on every rank too."""

    def __init__(self, group: ProcessGroup):
        self.group = group

    @torch.no_grad()
    def __call__(self, weights_BST: torch.Tensor) -> torch.Tensor:
        total = weights_BST.clone()
        torch.distributed.all_reduce(total, group=self.group)
        return total


class DeltaNetRankPart:
    """A Gated DeltaNet's `own_part` under tp (module docstring): this rank's channels of the
    convolution ([q | k | v], each cut by key-head groups), its value heads' A_log and dt_bias, and
    the gated norm's weight whole, each through `copy_to_group` (forward the identity, backward the
    gradient summed over tp: each rank's part is only its heads' share of it)."""

    def __init__(self, layer: GatedDeltaNet, group: ProcessGroup):
        tp, rank = group.size(), group.rank()
        keys, values = self._sizes(layer)
        k_part, v_part = keys // tp, values // tp
        self.group = group
        self.conv = torch.cat([torch.arange(start + rank * part, start + (rank + 1) * part)
                               for start, part in ((0, k_part), (keys, k_part), (2 * keys, v_part))])
        heads = layer.A_log.shape[0] // tp
        self.heads = slice(rank * heads, (rank + 1) * heads)

    @staticmethod
    def _sizes(layer: GatedDeltaNet) -> tuple[int, int]:
        channels = layer.conv1d.weight.shape[0]
        values = layer.A_log.shape[0] * layer.value_dim
        return (channels - values) // 2, values

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = copy_to_group(t, self.group)
        if name in ("conv", "qkv"):  # [q | k | v] channels by rows (Qwen3.5's in_proj_qkv: the same rows)
            return t.index_select(0, self.conv.to(t.device))
        return t if name in ("norm", "input") else t[self.heads]

    def cut(self, layer: GatedDeltaNet) -> None:
        """Keep only this rank's part of each whole weight the seam reads (serving, where nothing
        updates them after load), so the layer reads them as they are (`own_part` whole again)."""
        keep_part(layer.conv1d, "weight", self.conv)
        if layer.split:
            keep_part(layer.in_proj_qkv, "weight", self.conv)
        for name in ("A_log", "dt_bias"):
            keep_part(layer, name, _indices(self.heads))


class KdaRankPart(DeltaNetRankPart):
    """Kimi delta attention's `own_part` under tp: this rank's heads' channels of the [q | k | v]
    convolution and of dt_bias, its heads' A_log, the norm's weight whole (`DeltaNetRankPart`'s
    gradient sum over tp on each)."""

    def __init__(self, layer: KimiDeltaAttention, group: ProcessGroup):
        tp, rank = group.size(), group.rank()
        channels, heads = layer.q_proj.weight.shape[0] // tp, layer.heads // tp
        self.group = group
        self.conv = torch.cat([torch.arange(start + rank * channels, start + (rank + 1) * channels)
                               for start in (0, tp * channels, 2 * tp * channels)])
        self.heads = slice(rank * heads, (rank + 1) * heads)
        self.channels = slice(rank * channels, (rank + 1) * channels)

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name == "dt_bias":
            return copy_to_group(t, self.group)[self.channels]
        return super().__call__(name, t)

    def cut(self, layer: KimiDeltaAttention) -> None:
        """`DeltaNetRankPart.cut` for Kimi delta attention: each of the three convolutions' channels and
        dt_bias by this rank's channels, A_log [1, 1, H, 1] by its heads."""
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            keep_part(conv, "weight", _indices(self.channels))
        keep_part(layer, "dt_bias", _indices(self.channels))
        keep_part(layer, "A_log", _indices(self.heads), dim=2)


class MambaRankPart:
    """A Mamba-2 mixer's `own_part` under tp (module docstring): this rank's heads and the groups they
    read, as rows of in_proj ([z | x B C | dt]), channels of the convolution ([x | B | C]), entries of
    dt_bias, A_log and D and gains of the norm, each through `copy_to_group` (forward the identity,
    backward the gradient summed over tp), as the input is."""

    def __init__(self, layer: Mamba2Mixer, group: ProcessGroup):
        tp, rank = group.size(), group.rank()
        H, P, G, N = layer.n_heads, layer.head_dim, layer.n_groups, layer.state_size
        inner, h, g = H * P, H // tp, G // tp

        def span(start: int, size: int) -> torch.Tensor:
            return torch.arange(start + rank * size, start + (rank + 1) * size)

        self.group = group
        self.conv = torch.cat([span(0, h * P), span(inner, g * N), span(inner + G * N, g * N)])
        self.rows = torch.cat([span(0, h * P), inner + self.conv, span(2 * inner + 2 * G * N, h)])
        self.norm, self.heads = span(0, h * P), span(0, h)

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = copy_to_group(t, self.group)
        if name == "input":
            return t
        index = {"in_proj": self.rows, "conv": self.conv, "norm": self.norm, "heads": self.heads}[name]
        return t.index_select(0, index.to(t.device))

    def cut(self, layer: Mamba2Mixer) -> None:
        """`DeltaNetRankPart.cut` for Mamba-2: in_proj's rows, the convolution's channels, the heads'
        entries and the norm's gains of this rank, weights and biases."""
        for module, index in ((layer.in_proj, self.rows), (layer.conv1d, self.conv)):
            keep_part(module, "weight", index)
            keep_part(module, "bias", index)
        for name in ("A_log", "dt_bias", "D"):
            keep_part(layer, name, self.heads)
        keep_part(layer.norm, "weight", self.norm)


def _indices(part: slice) -> torch.Tensor:
    return torch.arange(part.start, part.stop)


@torch.no_grad()
def keep_part(module: nn.Module, name: str, index: torch.Tensor, dim: int = 0) -> None:
    """`module`'s parameter `name` (if it has one) replaced by its entries `index` along `dim`, a tensor
    of its own: the whole one is freed once nothing else holds it. The part remembers where it came
    from (`whole_index`: (dim, index)), so a whole tensor can be copied into it later."""
    p = getattr(module, name)
    if p is not None:
        index = index.to(p.device)
        part = nn.Parameter(p.index_select(dim, index).contiguous(), requires_grad=p.requires_grad)
        part.whole_index = (dim, index)
        setattr(module, name, part)


class VocabParallelTiedHead:
    """The model's `tied_head` under tp: logits of this rank's vocabulary slice from the
    embedding's own weight (a DTensor sharded on the vocabulary, the one the vocab-parallel
    embedding uses), returned as a DTensor sharded on V like the untied head's. The final hidden
    states (replicated, or sharded on the sequence under sp) are made whole first; their
    gradient comes back summed over tp (reduce-scattered under sp) through DTensor's autograd."""

    def __init__(self, tp_mesh: DeviceMesh, stream: Placement):
        self.mesh, self.stream = tp_mesh, stream

    def __call__(self, h_BSD: torch.Tensor, embedding_VD: torch.Tensor) -> torch.Tensor:
        if not isinstance(h_BSD, DTensor):
            h_BSD = DTensor.from_local(h_BSD, self.mesh, (self.stream,), run_check=False)
        h_BSD = h_BSD.redistribute(self.mesh, (Replicate(),))
        return h_BSD @ embedding_VD.T  # [B, S, V] sharded on V: Replicate x Shard(1)


def model_plan(sp: bool, whole_embeddings: bool = False) -> dict[str, ParallelStyle]:
    """Embedding, final norm and head (names relative to the Transformer). `whole_embeddings`: the
    embedding's output is the whole sequence even under sp (module docstring of apply_tensor_parallel)."""
    stream = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Replicate() if whole_embeddings else stream),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sp: bool, whole_embeddings: bool = False) -> None:
    """Apply the plans in place. Weights must already be identical on every tp rank (initialised
    from one seed): each rank keeps its own slice without communication. `whole_embeddings`: under
    sp the embedding still returns the whole sequence on every tp rank (all-reduced, not
    reduce-scattered), and the caller cuts this rank's slice of it: a vision-language model merges
    its image rows into the whole sequence first (tessera.parallel.vision_language)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # train.lora's base, a frozen tower
    top = {k: v for k, v in model_plan(sp, whole_embeddings).items() if getattr(model, k, None) is not None}
    parallelize_module(model, tp_mesh, top, src_data_rank=None)
    if sp:  # a later pipeline stage's input is the local sequence slice of the stream
        model.received_sequence_shards = tp_mesh.size()
    if model.cfg.tie_embeddings and model.tok_embeddings is not None:
        model.tied_head = VocabParallelTiedHead(tp_mesh, Shard(1) if sp else Replicate())
    mtp = getattr(model, "mtp", None) or {}
    for block in [*model.layers.values(), *(m.block for m in mtp.values())]:
        parallelize_module(block, tp_mesh, block_plan(block, sp), src_data_rank=None)
        if isinstance(getattr(block, "attention", None), MultiHeadLatentAttention):
            block.attention.share_rope_key = SumOverRanksHeads(tp_mesh.get_group())
        if isinstance(getattr(block, "attention", None), SparseLatentAttention):
            block.attention.head_sum = HeadSumOverRanks(tp_mesh.get_group())
        mixer = getattr(block, "attention", None)
        if isinstance(mixer, GatedDeltaNet):
            mixer.own_part = DeltaNetRankPart(mixer, tp_mesh.get_group())
        if isinstance(mixer, KimiDeltaAttention):
            mixer.own_part = KdaRankPart(mixer, tp_mesh.get_group())
        if isinstance(mixer, Mamba2Mixer):
            mixer.own_part = MambaRankPart(mixer, tp_mesh.get_group())
    if mtp:
        model.token_loss = vocab_parallel_loss_sum
    if mtp and sp:
        local = SequenceParallel(use_local_output=True)  # the residual stream stays a local tensor
        # The projection takes the whole sequence and hands back this rank's slice: its weight
        # stays a plain tensor whose gradient every rank computes whole (a sequence-parallel weight's
        # would be a partial sum).
        whole = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        for m in mtp.values():
            parallelize_module(m, tp_mesh, {"enorm": local, "hnorm": local, "eh_proj": whole,
                                            "norm": SequenceParallel()}, src_data_rank=None)
    for name, p in model.named_parameters():  # SequenceParallel makes its parameters anew, requiring gradients
        if name in frozen:
            p.requires_grad_(False)

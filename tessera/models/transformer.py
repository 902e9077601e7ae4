"""The decoder: embedding, pre-norm blocks (attention + SwiGLU or MoE; one sublayer each where the
model says so, sublayer_block.py), final RMSNorm, LM head.

A plain single-device module. Layers live in an `nn.ModuleDict` keyed by str(layer index), so a
pipeline stage that drops layers keeps the names of the ones it owns. `forward` reads one
`ModelInput` (model_input.py: token ids or hidden states, positions, cache, targets, and what a
call computes besides logits), or token ids alone: `model(ids)`.

Where a token sits in its sequence (what RoPE rotates by) is a seam, `position_source` (a
`PositionSource`), used when the caller passes no `positions`: on one process token j of the
input is at position j; context parallelism (`tessera.parallel`) installs one that places this
rank's chunk at its global positions. With tied embeddings (`tie_embeddings`) the LM head is
the embedding matrix, applied through a seam too, `tied_head` (a `TiedHead`): `h @ E^T` on one
process; tensor parallelism installs one that computes the logits of this rank's vocabulary slice.

The loss is a seam too: given `targets`, a model with `loss_chunk_tokens` > 0 returns the sum of
its token losses (`ModelOutput.loss_sum`, by `chunked_linear_cross_entropy`) instead of logits,
so the whole micro-batch's full-vocabulary logits never exist. A head that tensor parallelism
has cut over the vocabulary (a DTensor weight) keeps returning logits for the vocabulary-parallel
loss. Shapes: B batch, S sequence, D model dim, V vocabulary.

With `model.mtp_depth` > 0 the model holds DeepSeek-V3's multi-token-prediction modules
(`mtp`, tessera/models/mtp.py) and, given targets, returns their token-loss sums
(`ModelOutput.mtp_loss_sums`, and `mtp_loss_sum`, the weighted sum the objective adds). Their
cross-entropy over plain logits goes through a seam, `token_loss` (a `TokenLoss`): torch's on one
process; tensor parallelism installs the vocabulary-parallel one. Their shifted token ids come through
another, `mtp_sequence` (a `TokenSequence`, mtp.py): context parallelism installs one that shifts
across its chunks.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tessera.config.model import ModelConfig
from tessera.models.attention import Attention, AttentionCache
from tessera.models.attention_variants.indexer_loss import AttentionLosses, with_attention_losses
from tessera.models.attention_variants.sparse_mla import SparseLatentAttention
from tessera.models.chunked_cross_entropy import IGNORE_INDEX, chunked_linear_cross_entropy
from tessera.models.lazy_torch import is_dtensor
from tessera.models.linear_attention.gated_deltanet import GatedDeltaNet
from tessera.models.linear_attention.kimi_delta_attention import KimiDeltaAttention
from tessera.models.mla import MultiHeadLatentAttention
from tessera.models.mlp import feed_forward
from tessera.models.model_input import ModelInput
from tessera.models.moe.layer import MoE
from tessera.models.moe.router import RouterOutput
from tessera.models.mtp import MTPModule, TokenSequence, depth_inputs, depth_targets
from tessera.models.norm import RMSNorm
from tessera.models.rope import longrope_long_frequencies, longrope_pick, rope_cos_sin, rope_frequencies
from tessera.models.sublayer_block import decoder_layer


@dataclass
class RopeTables:
    """RoPE's cos and sin [B, S, D] for every layer, and the window layers' own (`local`, a (cos, sin)
    pair) when they rotate by another base (model.local_rope_theta)."""

    cos: torch.Tensor
    sin: torch.Tensor
    local: tuple[torch.Tensor, torch.Tensor] | None = None
    q_scale: torch.Tensor | None = None  # [B, S, 1, 1] fp32: the NoPE layers' query temperature (Llama 4)

    def query_scale(self, cfg: ModelConfig, layer_id: int) -> torch.Tensor | None:
        return self.q_scale if layer_id in cfg.nope_layers else None

    def of_layer(self, cfg: ModelConfig, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.local is not None and cfg.layer_window(layer_id) is not None:
            return self.local
        return self.cos, self.sin


# (B, S, device) -> positions [B, S] of the input's tokens in their sequences.
PositionSource = Callable[[int, int, torch.device], torch.Tensor]


def kept_in_fp32(name: str) -> bool:
    """Whether tensor `name` of a model stays fp32 whatever the model's dtype: the aux-loss-free
    routing bias (DeepSeek-V3), whose small fixed-step updates bf16 would round away, and which
    chooses experts by comparisons a rounding can flip (HuggingFace keeps e_score_correction_bias
    in fp32 as well)."""
    return name.endswith("expert_bias")


def sequence_extent(source: PositionSource, S: int) -> int:
    """How many positions the whole sequence spans when `source` places an input of S tokens: S on
    one process; a source whose input is a chunk of the sequence says so (`sequence_length`:
    context parallelism's). LongRoPE picks its table by it, the same on every rank."""
    length = getattr(source, "sequence_length", None)
    return length(S) if length is not None else S


def sequence_positions(B: int, S: int, device: torch.device) -> torch.Tensor:
    """The `PositionSource` of one process: the input is the whole sequence, from position 0."""
    return torch.arange(S, device=device).expand(B, S)


# (final hidden states [B, S, D], embedding weight [V, D]) -> logits [B, S, V].
TiedHead = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# (logits [B, S, V], targets [B, S] with IGNORE_INDEX) -> fp32 sum of the token cross-entropies.
TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def select_positions(h_BSD: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of `h_BSD` at sequence indices `index`: [R], the same for every row, or [B, R], each row's own."""
    if index.dim() == 1:
        return h_BSD.index_select(1, index)
    return h_BSD.gather(1, index[:, :, None].expand(-1, -1, h_BSD.shape[-1]))


def plain_token_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """The `TokenLoss` of one process: torch's cross-entropy in fp32, summed."""
    V = logits_BSV.shape[-1]
    return F.cross_entropy(logits_BSV.float().reshape(-1, V), targets_BS.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def tied_projection(h_BSD: torch.Tensor, embedding_VD: torch.Tensor) -> torch.Tensor:
    """The `TiedHead` of one process: logits against every row of the embedding matrix."""
    return h_BSD @ embedding_VD.T


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, S, V] (None: no head, a middle pipeline stage; or loss_sum given)
    # fp32 scalar: the sum of every MoE layer's weighted balancing losses (and sparse attention's indexer
    # loss under train.indexer_loss, attention_variants/indexer_loss.py)
    aux_loss: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)  # "layer{i}/{name}" -> weighted loss
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> routing slots per expert
    hidden: torch.Tensor | None = None  # final hidden states [B, S, D] before the head
    last_hidden: torch.Tensor | None = None  # the last layer's output [B, S, D], before the final norm
    loss_sum: torch.Tensor | None = None  # fp32 sum of token losses, when the model computed it (chunked)
    # multi-token prediction, given targets: depth k -> fp32 sum of its token losses; their
    # weighted sum mtp_loss_weight / mtp_depth * sum_k (what the objective adds to the main sum)
    mtp_loss_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    mtp_loss_sum: torch.Tensor | None = None
    mtp_objective: torch.Tensor | None = None  # mtp_loss_sum / mtp_divisor, when forward was given one
    # the residual stream after each block count of forward's `keep_layers`, concatenated [B, S, len x D]
    kept_hidden: torch.Tensor | None = None


def block_norm(cfg: ModelConfig) -> RMSNorm:
    """An RMSNorm over the model dimension, with Gemma's (1 + weight) where the model has it."""
    return RMSNorm(cfg.dim, cfg.norm_eps, cfg.norm_unit_offset)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings multiplied by sqrt(dim) (model.embed_scale, Gemma 3), the factor first
    rounded to the weight's dtype as transformers does; the weight itself (a tied head's) unscaled."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scale = float(torch.tensor(self.embedding_dim**0.5, dtype=self.weight.dtype))
        return super().forward(ids) * scale


def _normed(norm: RMSNorm | None, x_BSD: torch.Tensor) -> torch.Tensor:
    return x_BSD if norm is None else norm(x_BSD)


def token_mixer(cfg: ModelConfig, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s token mixer, the block's `attention`: Gated DeltaNet (or Kimi delta
    attention, model.linear_attention.kind) on a hybrid model's linear-attention layers
    (tessera/models/linear_attention), multi-head latent attention (DeepSeek; over the keys a
    lightning indexer picks with `mla.index_topk`, DeepSeek-V3.2), else softmax attention. Each
    takes (x, cos, sin, cache) and returns [B, S, D]."""
    if cfg.is_linear_attention_layer(layer_id):
        return (KimiDeltaAttention if cfg.linear_attention.kind == "kda" else GatedDeltaNet)(cfg, layer_id)
    if cfg.mla is not None and cfg.mla.index_topk is not None:
        return SparseLatentAttention(cfg, layer_id)
    return (MultiHeadLatentAttention if cfg.mla is not None else Attention)(cfg, layer_id)


class TransformerBlock(nn.Module):
    """Attention then MLP (or MoE), each added to the residual stream, with RMSNorms before them
    (`attention_norm`, `ffn_norm`), after them (`attention_post_norm`, `ffn_post_norm`) or both, as
    `cfg.block_norms` says; the norms a block does not have are None."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        pre, post = cfg.block_norms in ("pre", "pre_post"), cfg.block_norms in ("post", "pre_post")
        self.attention_norm = block_norm(cfg) if pre else None
        self.attention = token_mixer(cfg, layer_id)
        self.attention_post_norm = block_norm(cfg) if post else None
        self.ffn_norm = block_norm(cfg) if pre else None
        if cfg.is_moe_layer(layer_id):
            self.moe = MoE(cfg.dim, cfg.moe)
        else:
            self.feed_forward = feed_forward(cfg.dim, cfg.ffn_dim, cfg.activation)
        self.ffn_post_norm = block_norm(cfg) if post else None
        # (x, cos, sin, cache) -> the block's output in one call, or None where it does not apply now (then
        # the modules run): serving on CPU installs one for a dense layer of GGUF blocks
        # (tessera.infer.cpu.gguf_layer); None everywhere else
        self.fused_layer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionCache | None],
                                   torch.Tensor | None] | None = None

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache | None = None,
                q_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterOutput | AttentionLosses | None]:
        if self.fused_layer is not None and q_scale is None:
            y = self.fused_layer(x_BSD, cos, sin, cache)
            if y is not None:
                return y, None
        a = self.attention(_normed(self.attention_norm, x_BSD), cos, sin, cache, **(
            {} if q_scale is None else {"q_scale": q_scale}))
        a, mixer_losses = a if isinstance(a, tuple) else (a, None)  # sparse attention's indexer loss
        x_BSD = x_BSD + _normed(self.attention_post_norm, a)
        h = _normed(self.ffn_norm, x_BSD)
        route = None
        if hasattr(self, "moe"):
            y, route = self.moe(h)
        else:
            y = self.feed_forward(h)
        return x_BSD + _normed(self.ffn_post_norm, y), with_attention_losses(route, mixer_losses)


def name_seed(seed: int, name: str) -> int:
    """The seed of parameter `name`'s initial values: the same whatever the layout or device order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_by_name(named: Iterable[tuple[str, torch.Tensor]], norms: set[str] | dict[str, float], seed: int,
                 std: float) -> None:
    """Each tensor from (seed, its name) alone: the norm weights `norms` 1 (or, given a dict, the
    value it names), biases 0, the rest N(0, std) drawn in fp32."""
    for name, p in named:
        if name in norms:
            p.fill_(norms[name] if isinstance(norms, dict) else 1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            gen = torch.Generator().manual_seed(name_seed(seed, name))
            full = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(full.to(p.dtype))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, init_seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = (ScaledEmbedding if cfg.embed_scale else nn.Embedding)(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): decoder_layer(cfg, i, TransformerBlock) for i in range(cfg.n_layers)})
        self.norm = block_norm(cfg)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # multi-token prediction depths 1..mtp_depth, keyed "1".. (tessera/models/mtp.py)
        self.mtp = nn.ModuleDict({
            str(k): MTPModule(cfg.dim, cfg.norm_eps, TransformerBlock(cfg, cfg.n_layers + k - 1))
            for k in range(1, cfg.mtp_depth + 1)}) if cfg.mtp_depth > 0 else None
        self.token_loss: TokenLoss = plain_token_loss  # the MTP losses' cross-entropy (module docstring)
        # where MTP shifts token ids: the whole sequence (context parallelism installs its own; mtp.py)
        self.mtp_sequence = TokenSequence()
        self.register_buffer("rope_inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("local_rope_inv_freq", torch.empty(0), persistent=False)
        self.register_buffer("rope_long_inv_freq", torch.empty(0), persistent=False)  # LongRoPE's long table
        self.reset_rope()
        self.position_source: PositionSource = sequence_positions
        # Multimodal RoPE (Qwen2-VL): the (t, h, w) groups of rotary pairs that positions [3, B, S] rotate.
        self.mrope_section: list[int] | None = None
        self.mrope_interleaved = False  # Qwen3-VL / Qwen3.5: the groups' pairs dealt in turn (rope.py)
        # A later pipeline stage receives hidden states; under sequence parallelism they are this
        # rank's 1/tp of the sequence, so the sequence is this many times longer (RoPE positions are global).
        self.received_sequence_shards = 1
        self.tied_head: TiedHead = tied_projection  # used when cfg.tie_embeddings (module docstring)
        # Tokens per chunk of the chunked LM-head loss when `forward` gets targets; 0 = off (logits).
        self.loss_chunk_tokens = 0
        # (h, rope, cache) -> the last layer's output in one call, or None (then the layers run): serving on CPU
        # installs one where every layer is a dense one of GGUF blocks (tessera.infer.cpu.gguf_layer)
        self.fused_stack: Callable[[torch.Tensor, RopeTables, AttentionCache | None], torch.Tensor | None] | None = None
        if init_seed is not None:
            self.init_weights(init_seed)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE frequencies, e.g. after building on the meta device."""
        cfg = self.cfg
        rope_dim = cfg.rope_dim  # the head's rotated part: all of it, MLA's RoPE part, or a partial share
        device = torch.device(device if device is not None else self.rope_inv_freq.device)
        # built on the meta device, the tables are computed on the CPU (then left on meta, as the weights):
        # arithmetic on meta tensors runs torch's Python references, which import torch._dynamo
        with torch.device("cpu") if device.type == "meta" else contextlib.nullcontext():
            inv_freq, self.rope_attention_factor = rope_frequencies(rope_dim, cfg.rope_theta, cfg.rope_scaling)
            long = longrope_long_frequencies(rope_dim, cfg.rope_theta, cfg.rope_scaling)
            local = rope_frequencies(rope_dim, cfg.local_rope_theta)[0] if cfg.local_rope_theta is not None else None
        self.rope_inv_freq = inv_freq.to(device)
        self.rope_long_inv_freq = long.to(device) if long is not None else torch.empty(0, device=device)
        # the window layers' own RoPE (model.local_rope_theta), unscaled; empty when they share the above
        self.local_rope_inv_freq = local.to(device) if local is not None else torch.empty(0, device=device)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, extent: int | None = None) -> RopeTables:
        """RoPE's cos and sin at `positions` (`rope_cos_sin`), and the window layers' own where they
        have one (model.local_rope_theta). LongRoPE's table is the long one when the sequence spans
        more than its original length: `extent` positions when the caller knows it, else the call's
        largest position decides (rope.py)."""
        inv_freq = self.rope_inv_freq
        if self.rope_long_inv_freq.numel():
            original = int(self.cfg.rope_scaling["original_max_position_embeddings"])
            if extent is None:
                inv_freq = longrope_pick(positions, inv_freq, self.rope_long_inv_freq, original)
            elif extent > original:
                inv_freq = self.rope_long_inv_freq
        mrope = (self.mrope_section, self.mrope_interleaved)
        cos_sin = rope_cos_sin(positions, inv_freq, self.rope_attention_factor, dtype, *mrope)
        local = None
        if self.local_rope_inv_freq.numel():
            local = rope_cos_sin(positions, self.local_rope_inv_freq, 1.0, dtype, *mrope)
        q_scale = None
        if self.cfg.nope_attn_scale > 0:  # Llama 4's temperature tuning (model.nope_attn_scale)
            steps = torch.floor((positions.float() + 1.0) / self.cfg.nope_floor_scale)
            q_scale = (1.0 + self.cfg.nope_attn_scale * torch.log1p(steps))[..., None, None]
        return RopeTables(*cos_sin, local, q_scale)

    def cast(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Transformer:
        """`to(device, dtype)`, except that the tensors of `kept_in_fp32` stay fp32 (their values
        unrounded). Returns the model."""
        kept = {n: b for n, b in self.named_buffers() if kept_in_fp32(n)}  # `to` replaces, never changes, them
        self.to(device=device, dtype=dtype)
        for name, b in kept.items():
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, b.to(device=device, dtype=torch.float32))
        return self

    # ---- initialisation --------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Every tensor from (seed, its name) alone, so any layout or device order gives the same
        model: norms 1, biases and expert biases 0, matrices N(0, init_std)."""
        norms = {f"{mn}.weight": getattr(m, "initial_weight", 1.0) for mn, m in self.named_modules()
                 if isinstance(m, RMSNorm | nn.LayerNorm)}  # LayerNorm: sparse attention's indexer keys
        init_by_name(self.named_parameters(), norms, seed, self.cfg.init_std)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(m.initial_weight)  # 1, or Gemma's 0 under its (1 + weight)
        for name, b in self.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()

    @torch.no_grad()
    def initial_value(self, name: str, seed: int) -> torch.Tensor:
        """The whole fp32 CPU value `init_weights(seed)` gives parameter `name`, computed alone: a
        model built on the meta device and then sharded initialises each shard from it. A submodule
        with an `initial_value(name, seed)` of its own gives it (an adapter factor: models/lora.py)."""
        p = self.get_parameter(name)
        owner, _, leaf = name.rpartition(".")
        own = getattr(self.get_submodule(owner), "initial_value", None) if owner else None
        if own is not None:
            return own(name, seed)
        if leaf == "weight" and isinstance(self.get_submodule(owner), RMSNorm | nn.LayerNorm):
            return torch.full(p.shape, getattr(self.get_submodule(owner), "initial_weight", 1.0), dtype=torch.float32)
        if name.endswith(".bias"):
            return torch.zeros(p.shape, dtype=torch.float32)
        gen = torch.Generator().manual_seed(name_seed(seed, name))
        return torch.empty(p.shape, dtype=torch.float32).normal_(0.0, self.cfg.init_std, generator=gen)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, inp: ModelInput | torch.Tensor) -> ModelOutput:
        """Logits of every position of `inp` (a `ModelInput`, or token ids [B, S] alone); with
        `targets` [B, S] (IGNORE_INDEX: no loss) and `loss_chunk_tokens` > 0, the summed token loss
        instead (`ModelOutput.loss_sum`).

        Multi-token prediction runs when the model has it and targets are given: `mtp_inputs` /
        `mtp_targets` (default: `tokens` and `targets`) are the token ids and targets of the
        sequence, what a pipeline's last stage, which receives hidden states, is handed;
        `mtp_divisor` N also returns `mtp_objective` = mtp_loss_sum / N (the pipeline's stage
        adds it to its auxiliary loss).

        `keep_layers` (block counts j in 0..n_layers) also returns the residual stream after j blocks
        (0: the embedding; n_layers: `last_hidden`) for each j, concatenated over the features in that
        order (`kept_hidden`): what a draft fed with the target's hidden states reads (serving's
        MTP and EAGLE proposers, EAGLE training).

        `logit_positions` (sequence indices [R]) computes the logits of those positions only, [B, R, V]
        (serving reads the last row of each prompt chunk, not all of them), or per row ([B, R]: row
        b's positions, which may repeat: shared-prefix rows, shared_prefix.py); ignored when the hidden
        states are a DTensor (sequence-sharded), where the logits cover every position."""
        inp = ModelInput.of(inp)
        h, rope = self._entry(inp)
        cos, sin = rope.cos, rope.sin
        out = ModelOutput(logits=None, aux_loss=torch.zeros((), dtype=torch.float32, device=h.device))
        h_last = out.last_hidden = self._blocks(out, h, rope, inp)
        h = self.norm(h_last) if self.norm is not None else h_last
        out.hidden = h
        mtp_targets = inp.mtp_targets if inp.mtp_targets is not None else inp.targets
        mtp_inputs = inp.mtp_inputs if inp.mtp_inputs is not None else inp.tokens
        if self.mtp is not None and mtp_targets is not None and mtp_inputs is not None:
            self._multi_token_losses(out, h_last, mtp_inputs, mtp_targets, cos, sin)
            if inp.mtp_divisor is not None:
                out.mtp_objective = out.mtp_loss_sum / inp.mtp_divisor
        if inp.targets is not None and self.computes_chunked_loss(h):
            out.loss_sum = chunked_linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.head_weight(),
                                                        inp.targets.reshape(-1), self.loss_chunk_tokens)
            return out
        if inp.logit_positions is not None and not is_dtensor(h):
            h = select_positions(h, inp.logit_positions)
        out.logits = self.lm_head(h)
        return out

    def _entry(self, inp: ModelInput) -> tuple[torch.Tensor, RopeTables]:
        """The hidden states entering the first layer and RoPE's tables at the input's positions.
        Token ids are embedded; hidden states pass on (the last pipeline stage may hold the tied
        embedding), and under sequence parallelism they are this rank's 1/tp of the sequence, so the
        sequence is this many times longer (RoPE positions are global)."""
        x = inp.sequence
        B, S = x.shape[:2]
        if inp.hidden is not None:
            S *= self.received_sequence_shards
        extent = None if inp.positions is not None else sequence_extent(self.position_source, S)
        positions = inp.positions if inp.positions is not None else self.position_source(B, S, x.device)
        h = inp.hidden if inp.hidden is not None else self.tok_embeddings(inp.tokens)
        return h, self.rope_tables(positions, h.dtype, extent)

    def _blocks(self, out: ModelOutput, h: torch.Tensor, rope: RopeTables, inp: ModelInput) -> torch.Tensor:
        """The layers over `h`, their routing into `out`, and `out.kept_hidden` of `inp.keep_layers`;
        returns the last layer's output."""
        keep = inp.keep_layers
        if self.fused_stack is not None and not keep:
            y = self.fused_stack(h, rope, inp.cache)
            if y is not None:
                return y
        kept = {0: h} if 0 in keep else {}
        for key, layer in self.layers.items():
            h, route = layer(h, *rope.of_layer(self.cfg, int(key)), inp.cache,
                             q_scale=rope.query_scale(self.cfg, int(key)))
            self._add_route(out, f"layer{key}", int(key), route)
            if int(key) + 1 in keep:
                kept[int(key) + 1] = h
        if keep:
            out.kept_hidden = torch.cat([kept[j] for j in keep], dim=-1)
        return h

    @staticmethod
    def _add_route(out: ModelOutput, name: str, layer_id: int, route: RouterOutput | AttentionLosses | None) -> None:
        """A block's routing counts and auxiliary losses into `out` (nothing for a dense block without
        the indexer loss)."""
        if route is None:
            return
        if isinstance(route, RouterOutput):
            out.expert_counts[layer_id] = route.counts_E
        for loss_name, value in route.losses.items():
            out.aux_losses[f"{name}/{loss_name}"] = value
            out.aux_loss = out.aux_loss + value

    def _multi_token_losses(self, out: ModelOutput, h_BSD: torch.Tensor, input_ids: torch.Tensor,
                            targets: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Every depth's token-loss sum (tessera/models/mtp.py) and their weighted sum into `out`."""
        total, seq = None, self.mtp_sequence
        ids, tgt = seq.whole(input_ids), seq.whole(targets)  # shifts cross context-parallel chunks
        for key, module in self.mtp.items():
            k = int(key)
            h_BSD, route = module(h_BSD, self.tok_embeddings(seq.own(depth_inputs(ids, k))), cos, sin)
            self._add_route(out, f"mtp{k}", self.cfg.n_layers + k - 1, route)
            out.mtp_loss_sums[k] = self._head_loss_sum(module.norm(h_BSD), seq.own(depth_targets(tgt, k)))
            total = out.mtp_loss_sums[k] if total is None else total + out.mtp_loss_sums[k]
        out.mtp_loss_sum = total * (self.cfg.mtp_loss_weight / self.cfg.mtp_depth)

    def _head_loss_sum(self, h_BSD: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The shared head's summed token loss of normed hidden states: chunked where the main
        loss is, else through the `token_loss` seam."""
        if self.computes_chunked_loss(h_BSD):
            return chunked_linear_cross_entropy(h_BSD.reshape(-1, h_BSD.shape[-1]), self.head_weight(),
                                                targets.reshape(-1), self.loss_chunk_tokens)
        return self.token_loss(self.lm_head(h_BSD), targets)

    def lm_head(self, h_BSD: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h_BSD)
        return self.tied_head(h_BSD, self.tok_embeddings.weight)

    def head_weight(self) -> torch.Tensor:
        """The [V, D] matrix the LM head multiplies with (the embedding's when tied)."""
        return self.output.weight if self.output is not None else self.tok_embeddings.weight

    def computes_chunked_loss(self, h_BSD: torch.Tensor) -> bool:
        """Whether `forward` with targets returns the chunked loss: on, with a whole local head
        (under tensor parallelism the head is sharded over V and the vocabulary-parallel loss runs)."""
        has_head = self.output is not None or (self.cfg.tie_embeddings and self.tok_embeddings is not None)
        return (self.loss_chunk_tokens > 0 and has_head
                and not is_dtensor(h_BSD) and not is_dtensor(self.head_weight()))

    # ---- balancing -------------------------------------------------------------------------
    @torch.no_grad()
    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """One aux-loss-free balancing step per MoE layer from its summed routing counts."""
        blocks = {int(k): b for k, b in self.layers.items()}
        blocks.update({self.cfg.n_layers + int(k) - 1: m.block for k, m in (self.mtp or {}).items()})
        for layer_id, c in counts.items():
            if layer_id in blocks and hasattr(blocks[layer_id], "moe"):
                blocks[layer_id].moe.router.update_bias(c)


"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning"): a vision tower, a projector, a language model.

The vision seam of a vision-language model is two calls, which the engine and the trainer use
without knowing the family:

- `encode_images(pixels)` -> one [T_i, D] tensor per image: the rows that take the places of that
  image's placeholder tokens, already in the language model's width. LLaVA runs the tower, picks
  `feature_layer`'s hidden states (dropping the first token under the "default" strategy) and
  projects them (linear, activation, linear); every image has `cfg.image_tokens` rows. A caller
  may cache these per image (the serving engine does, by content hash).
- `forward(input_ids, image_features=...)`: the token embeddings with each run of
  `image_token_id` placeholders replaced, in order, by the images' rows (`merge_image_features`),
  then the language model (`Transformer`, any dense family) on those embeddings with its own
  positions, cache seam and loss.

A family with its own positions for image tokens (Qwen2-VL's M-RoPE) keeps these two calls and
passes its positions through `forward`'s `positions`, as context parallelism does for text.

Training layouts reach LLaVA through two seams, installed from outside
(tessera.parallel.vision_language): `sequence` (a `RowSequence`: the whole sequence's ids from the
ones this rank holds, and this rank's rows of the merged embeddings; context and sequence
parallelism cut the sequence only after the image rows are in it; a family with its own positions
keeps this rank's of the whole rows' through `own_positions`), and a pipeline stage's cut
(tessera.parallel.pipeline: the tower and projector stay on the first stage, a later stage's
`forward` receives the previous stage's hidden states and hands them to its layers).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.config.errors import ModelError
from tessera.config.vision import LlavaConfig
from tessera.models.attention import AttentionCache
from tessera.models.model_input import ModelInput
from tessera.models.mtp import TokenSequence
from tessera.models.norm import RMSNorm
from tessera.models.transformer import ModelOutput, Transformer, init_by_name
from tessera.models.vision_tower import VisionTransformer, activation


def merge_image_features(embeds_BSD: torch.Tensor, input_ids: torch.Tensor, image_token_id: int,
                         features: list[torch.Tensor]) -> torch.Tensor:
    """`embeds_BSD` with the rows at `image_token_id` placeholders replaced, in row-major order, by
    the rows of `features` (one [T_i, D] tensor per image, in the order the images appear)."""
    mask = input_ids == image_token_id
    placeholders = int(mask.sum())
    rows = sum(int(f.shape[0]) for f in features)
    if placeholders != rows:
        images = sum(1 for f in features if f.shape[0])  # an empty tensor: no image (it keeps the tower in the graph)
        raise ModelError(f"the prompt has {placeholders} image placeholder tokens (id {image_token_id}) but its "
                         f"{images} image(s) give {rows} feature rows; each image needs exactly its rows")
    if not features:
        return embeds_BSD
    flat = torch.cat(features).to(embeds_BSD.dtype)
    return embeds_BSD.masked_scatter(mask.unsqueeze(-1), flat)


class RowSequence(TokenSequence):
    """A vision-language model's `sequence` seam on one process: the ids it holds are the whole rows
    (`whole`), the merged embeddings all its own (`own`), and so are rotary positions computed from
    the whole rows (`own_positions`). Context and sequence parallelism install `RankRows`
    (tessera.parallel.vision_language)."""

    def own_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """This rank's positions of the whole rows' rotary positions [..., S] (the sequence last), in
        the order it holds its tokens: the positions the language model's RoPE takes for its input."""
        return positions


class LlavaProjector(nn.Module):
    """LLaVA-1.5's two-layer MLP from the (concatenated) vision features to the model width."""

    def __init__(self, cfg: LlavaConfig):
        super().__init__()
        self.act = cfg.projector_act
        width = cfg.vision.dim * len(cfg.feature_layers)
        self.linear_1 = nn.Linear(width, cfg.text.dim, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text.dim, cfg.text.dim, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


class VisionLanguageModel(nn.Module):
    """What the vision-language families share: `cfg` (with `text` and `image_token_id`), a
    `language_model` (`Transformer`) and the image side, every module but the language model."""

    cfg: LlavaConfig
    language_model: Transformer

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """The language model by its own rule; the image side from (seed, name): norm weights 1,
        biases 0, the rest N(0, init_std)."""
        self.language_model.init_weights(seed)
        norms = {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, nn.LayerNorm | RMSNorm)}
        own = ((n, p) for n, p in self.named_parameters() if not n.startswith("language_model."))
        init_by_name(own, norms, seed, self.cfg.text.init_std)

    def image_side_in_graph(self, h: torch.Tensor) -> torch.Tensor:
        """`h`, in training with gradients on, plus 0 x the image side's trainable parameters: a
        forward without image rows still gives each of them a (zero) gradient. Under data
        parallelism every rank reduces the gradients its parameters hold, so a rank whose rows were
        all text would otherwise leave the tower's out and reduce another set than its peers (gloo
        fails, NCCL hangs); one process follows the same rule, so a step without images anywhere
        steps the optimizer alike in both."""
        if not (self.training and torch.is_grad_enabled()):
            return h
        params = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("language_model.")]
        if not params:
            return h
        return h + 0.0 * torch.stack([p.sum() for p in params]).sum().to(h.dtype)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """The language model's RoPE frequencies (after building on the meta device)."""
        self.language_model.reset_rope(device)

    def cast(self, dtype: torch.dtype, device: torch.device | str | None = None) -> VisionLanguageModel:
        self.to(device=device, dtype=dtype)
        self.language_model.cast(dtype, device)
        return self

    def update_expert_bias(self, counts: dict[int, torch.Tensor]) -> None:
        """The language model's aux-loss-free balancing step (an MoE language model's routers)."""
        self.language_model.update_expert_bias(counts)


class Llava(VisionLanguageModel):
    def __init__(self, cfg: LlavaConfig, init_seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTransformer(cfg.vision)
        self.projector = LlavaProjector(cfg)
        self.language_model = Transformer(cfg.text, init_seed=None)
        # Where this rank's tokens sit in the whole sequence (module docstring): all of it on one process.
        self.sequence = RowSequence()
        if init_seed is not None:
            self.init_weights(init_seed)

    def encode_images(self, pixels_NCHW: torch.Tensor) -> list[torch.Tensor]:
        """One [image_tokens, D] tensor of language-model input rows per image (module docstring)."""
        if pixels_NCHW.shape[0] == 0:
            return []
        return list(self.image_rows(pixels_NCHW).split(self.cfg.image_tokens))

    def image_rows(self, pixels_NCHW: torch.Tensor) -> torch.Tensor:
        """Every image's rows, in order: [N x image_tokens, D]. With N = 0 the tower and projector
        still run (on nothing), so the empty result depends on their parameters."""
        hidden = self.vision_tower(pixels_NCHW, self.cfg.feature_layers)
        if self.cfg.select_strategy == "default":
            hidden = [h[:, 1:] for h in hidden]
        return self.projector(torch.cat(hidden, dim=-1)).flatten(0, 1)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_features: list[torch.Tensor] | None = None, positions: torch.Tensor | None = None,
                cache: AttentionCache | None = None, targets: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None) -> ModelOutput:
        """The language model's output on `input_ids` [B, S] whose image placeholders hold the
        images' features: `image_features` (from `encode_images`) or `pixel_values` [N, C, H, W]
        encoded here; neither for text (a decode step), where placeholder ids are not checked.

        `image_mask` [B, K] with `pixel_values` [B, K, C, H, W]: each row's images padded to K, the
        true ones taken in row order. A pipeline schedule cuts its keyword tensors into micro-batches
        by rows, which one stack of a varying number of images per row cannot be.

        On a later pipeline stage `input_ids` are the previous stage's hidden states [B, S, D]: they
        go to this stage's layers (the stage has no image side, and images given to it are not used:
        an interleaved schedule hands every stage of a rank the same keyword arguments)."""
        if input_ids.is_floating_point():
            return self.language_model(ModelInput(hidden=input_ids, positions=positions, cache=cache,
                                                  targets=targets))
        if pixel_values is not None and image_features is not None:
            raise ModelError("give pixel_values or image_features, not both")
        if image_mask is not None:
            pixel_values = pixel_values[image_mask]
        if pixel_values is not None:
            # Also for a micro-batch without images ([one empty tensor]): the image side then takes
            # part in every backward (with zero gradients there), so every data-parallel rank has the
            # same gradients to reduce, and one process the same to step.
            image_features = list(self.image_rows(pixel_values).split(self.cfg.image_tokens))
        ids = self.sequence.whole(input_ids)
        h = self.language_model.tok_embeddings(ids)
        if image_features is not None:  # else text only: a generated placeholder id is a plain token
            h = merge_image_features(h, ids, self.cfg.image_token_id, image_features)
        else:  # no image side ran: in training, still a (zero) gradient for each of its parameters
            h = self.image_side_in_graph(h)
        return self.language_model(ModelInput(hidden=self.sequence.own(h), positions=positions, cache=cache,
                                              targets=targets))

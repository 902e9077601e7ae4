"""LLaVA (Liu et al. 2023, "Visual Instruction Tuning"): a vision tower, a projector, a language model.

The vision seam of a vision-language model (tessera/models/vision/vision_language.py) is two calls, which
the engine and the trainer use without knowing the family:

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

from tessera.config.errors import ConfigError, ModelError
from tessera.config.vision import LlavaConfig
from tessera.models.attention import AttentionCache
from tessera.models.model_input import ModelInput
from tessera.models.transformer import ModelOutput, Transformer
from tessera.models.vision.vision_language import ImageInput, RowSequence, VisionLanguageModel, merge_image_features
from tessera.models.vision.vision_tower import VisionTransformer, activation


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

    def image_input(self, image) -> ImageInput:
        """A served image: pixel values [C, H, W] of the tower's size, `image_tokens` placeholders."""
        size = (self.cfg.vision.num_channels,) + (self.cfg.vision.image_size,) * 2
        if tuple(image.shape) != size:
            raise ConfigError(f"image pixel values must be {list(size)} (the image processor's output); got "
                              f"{list(image.shape)}")
        return ImageInput(image, self.cfg.image_tokens, None)

    def unused_tower_modules(self) -> list[nn.Module]:
        """The tower's blocks past the deepest feature layer and its final LayerNorm: no forward runs
        them (their weights travel unchanged to an export, which keeps them)."""
        deepest = max(self.cfg.feature_layers)
        return [block for key, block in self.vision_tower.layers.items() if int(key) >= deepest] + [
            self.vision_tower.post_norm]

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

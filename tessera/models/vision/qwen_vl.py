"""Qwen2-VL and Qwen2.5-VL: the native-resolution vision tower (tessera/models/vision/qwen_vision.py) and a
Qwen2 language model with multimodal rotary positions (M-RoPE). Qwen3.5's family
(tessera/models/vision/qwen3_vision.py) is this class with another tower (`QwenVL.tower`) and its
language model's M-RoPE interleaved.

The vision seam is every vision-language model's (tessera/models/vision/vision_language.py), with the
images' patch grids beside their pixels: `encode_images(pixel_values, image_grid_thw)` gives one
[T_i, D] tensor per image, T_i = t x h x w / merge^2 known from the grid before the forward, and
`forward(input_ids, image_features=..., image_grid_thw=...)` puts them in the places of the
`image_token_id` placeholders (`merge_image_features`).

Positions are 3-D (`mrope_positions`): a text token at running position p has (p, p, p); an
image's tokens, starting at p, have (p + frame, p + row, p + column) of their merged grid, and the
text after the image resumes at p + max(rows, columns). Rows without images are plain 0..S-1. A
decode step continues from the prompt's largest position + 1, so token j of a row (j >= S) sits
at j + delta with delta = max position + 1 - S (`mrope_positions`' second result); the caller
passes those positions (2-D [B, S] is enough: the three coordinates are equal after the prompt).

Training layouts reach QwenVL through LLaVA's seams (tessera.parallel.vision_language), and the
positions follow the rows. Under cp and sp the `sequence` seam gives `forward` the whole rows' ids:
it merges the images into the whole rows, computes their M-RoPE positions there, and keeps this
rank's rows of the embeddings (`own`: its cp chunk, then its sp slice) and its positions of the
positions (`own_positions`: its cp chunk only; under sp the language model's RoPE takes the
positions of the whole sequence, as its attention rotates the gathered one, which is what a later
pipeline stage of a text model under sp does). Under pp only the first stage gets ids, yet every
stage's RoPE needs the positions: the step engine computes each rank's rows' positions from the
batch it holds and hands them to every stage, rows first (`row_positions`), and the first stage's
images padded per row (`image_mask`), so that the schedule cuts both into its micro-batches.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.config.errors import ConfigError, ModelError
from tessera.config.qwen_vl import QwenVLConfig
from tessera.models.attention import AttentionCache
from tessera.models.model_input import ModelInput
from tessera.models.transformer import ModelOutput, Transformer
from tessera.models.vision.qwen_vision import QwenVisionTransformer
from tessera.models.vision.vision_language import ImageInput, RowSequence, VisionLanguageModel, merge_image_features


def mrope_positions(input_ids: torch.Tensor, image_token_id: int, grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE positions [3, B, S] of `input_ids` [B, S] whose placeholder runs take the images of
    `grids` ((t, h, w) patches each, in row-major order of their placeholders), and each row's
    decode offset [B] (max position + 1 - S)."""
    B, S = input_ids.shape
    out = torch.empty(3, B, S, dtype=torch.long)
    deltas = torch.empty(B, dtype=torch.long)
    is_image = (input_ids == image_token_id).cpu()
    images = iter(grids)
    for b in range(B):
        j, pos = 0, 0
        flags = is_image[b].tolist()
        while j < S:
            if not flags[j]:
                end = j
                while end < S and not flags[end]:
                    end += 1
                out[:, b, j:end] = torch.arange(pos, pos + end - j)
                pos += end - j
                j = end
                continue
            grid = next(images, None)
            if grid is None:
                raise ModelError(f"row {b} has more image placeholder runs than the {len(grids)} image grid(s) given")
            t, H, W = grid[0], grid[1] // merge, grid[2] // merge
            n = t * H * W
            if j + n > S or not all(flags[j:j + n]):
                raise ModelError(f"row {b}: an image with grid {grid} needs {n} consecutive placeholder tokens "
                                 f"(id {image_token_id}) from position {j}")
            thw = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(H), torch.arange(W), indexing="ij"))
            out[:, b, j:j + n] = thw.reshape(3, -1) + pos
            pos += max(H, W)
            j += n
        deltas[b] = int(out[:, b].max()) + 1 - S if S else 0
    if next(images, None) is not None:
        raise ModelError(f"{len(grids)} image grid(s) given but the placeholders hold fewer images")
    return out.to(input_ids.device), deltas.to(input_ids.device)


def unpadded_images(pixels_BPF: torch.Tensor, grids_BK3: torch.Tensor, mask_BK: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(patch rows [sum P_i, F], grids [N, 3]) in row order from each row's images padded for a
    pipeline schedule (pipeline_step.padded_images): `grids_BK3` each row's grids padded to K,
    `mask_BK` true at the real ones, `pixels_BPF` each row's patch rows padded to P, of which the
    first t x h x w of each real grid, summed, are real."""
    grids = grids_BK3[mask_BK]
    patches = (grids_BK3.prod(-1) * mask_BK).sum(-1)  # [B] real patch rows per row
    keep = torch.arange(pixels_BPF.shape[1], device=pixels_BPF.device) < patches.to(pixels_BPF.device)[:, None]
    return pixels_BPF[keep], grids


class QwenVL(VisionLanguageModel):
    tower = QwenVisionTransformer  # the vision tower's class (Qwen3.5's: tessera/models/vision/qwen3_vision.py)

    def __init__(self, cfg: QwenVLConfig, init_seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.vision_tower = self.tower(cfg.vision)
        self.language_model = Transformer(cfg.text, init_seed=None)
        self.language_model.mrope_section = list(cfg.mrope_section)
        self.language_model.mrope_interleaved = cfg.mrope_interleaved
        # Where this rank's tokens sit in the whole rows (module docstring): all of them on one process.
        self.sequence = RowSequence()
        if init_seed is not None:
            self.init_weights(init_seed)

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One [t x h x w / merge^2, D] tensor of language-model input rows per image."""
        if image_grid_thw.shape[0] == 0:
            return []
        return self.vision_tower(pixel_values, image_grid_thw)

    def image_input(self, image) -> ImageInput:
        """A served image: (patch rows [t x h x w, patch values], (t, h, w)) as the image processor
        makes it, taking t x h x w / merge^2 placeholders."""
        rows = self.cfg.vision.patch_values
        ok = isinstance(image, tuple) and len(image) == 2 and len(image[1]) == 3
        if not ok or image[0].ndim != 2 or image[0].shape != (math.prod(int(x) for x in image[1]), rows):
            raise ConfigError(f"a Qwen2-VL image must be (patch rows [t*h*w, {rows}], (t, h, w)) as the image "
                              "processor makes it")
        grid = tuple(int(x) for x in image[1])
        return ImageInput(image[0], self.cfg.image_tokens(grid), grid)

    def image_part_ids(self) -> list[int]:
        """As Qwen2-VL's chat template writes an image part: the image token between vision start and end."""
        return [self.cfg.vision_start_token_id, self.cfg.image_token_id, self.cfg.vision_end_token_id]

    def part_modules(self, part: str) -> list[nn.Module]:
        """The projector is the tower's patch merger (what maps the tower's features into the language
        model's width, as LLaVA's projector does), so the vision tower is the rest of the tower."""
        tower = self.vision_tower
        return {"vision_tower": [tower.patch_embed, tower.layers], "projector": [tower.merger],
                "language_model": [self.language_model]}[part]

    def rope_positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """M-RoPE positions [3, B, S] of a prompt (module docstring)."""
        grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]
        return mrope_positions(input_ids, self.cfg.image_token_id, grids, self.cfg.vision.spatial_merge_size)[0]

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, image_features: list[torch.Tensor] | None = None,
                positions: torch.Tensor | None = None, cache: AttentionCache | None = None,
                targets: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                row_positions: torch.Tensor | None = None) -> ModelOutput:
        """The language model's output on `input_ids` [B, S] whose placeholders hold the images'
        features: `image_features` (from `encode_images`) or `pixel_values` encoded here, with the
        images' `image_grid_thw` [N, 3] either way. Without `positions`, a prompt's M-RoPE positions
        from the grids, computed on the whole rows (module docstring); neither images nor positions:
        a text prompt at 0..S-1 (the language model's own positions, this rank's under cp).

        A pipeline schedule cuts its keyword tensors into micro-batches by rows, which one stack of
        a varying number of images (and patch rows) per row cannot be, nor positions [3, B, S]:
        `image_mask` [B, K] with `image_grid_thw` [B, K, 3] and `pixel_values` [B, P, F] are each
        row's grids padded to K and patch rows to P (`unpadded_images`), and `row_positions`
        [B, 3, S] are `positions` rows first.

        On a later pipeline stage `input_ids` are the previous stage's hidden states [B, S, D]: they
        go to this stage's layers with those positions (images given to it are not used: an
        interleaved schedule hands every stage of a rank the same keyword arguments)."""
        if row_positions is not None:
            positions = row_positions.transpose(0, 1)
        if input_ids.is_floating_point():
            return self.language_model(ModelInput(hidden=input_ids, positions=positions, cache=cache,
                                                  targets=targets))
        if pixel_values is not None and image_features is not None:
            raise ModelError("give pixel_values or image_features, not both")
        if (pixel_values is not None or image_features is not None) and image_grid_thw is None:
            raise ModelError("images need their image_grid_thw (t, h, w patches each, from the image processor)")
        if image_mask is not None:
            pixel_values, image_grid_thw = unpadded_images(pixel_values, image_grid_thw, image_mask)
        if pixel_values is not None:
            image_features = self.encode_images(pixel_values, image_grid_thw)
        ids = self.sequence.whole(input_ids)  # under cp the whole rows, gathered from the chunks
        h = self.language_model.tok_embeddings(ids)
        if image_features is not None:
            h = merge_image_features(h, ids, self.cfg.image_token_id, image_features)
            if positions is None:
                positions = self.sequence.own_positions(self.rope_positions(ids, image_grid_thw))
        if not image_features:
            h = self.image_side_in_graph(h)
        return self.language_model(ModelInput(hidden=self.sequence.own(h), positions=positions, cache=cache,
                                              targets=targets))

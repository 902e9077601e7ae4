"""What every vision-language model is to the layers above it: the vision seam and the family's
answers to the engine and the trainer, so that neither names a family.

A vision-language model (`VisionLanguageModel`: LLaVA, tessera/models/vision/llava.py; Qwen2-VL /
Qwen2.5-VL, tessera/models/vision/qwen_vl.py) holds a `cfg` (with `text`, the language model's
`ModelConfig`, `vision`, the tower's config, and `image_token_id`), a `language_model`
(`Transformer`) and the image side, every module but the language model. Its vision seam is two
calls: `encode_images(...)` gives one [T_i, D] tensor of language-model input rows per image, and
`forward(input_ids, image_features=...)` puts them in the places of the `image_token_id`
placeholders (`merge_image_features`). Beside the seam, each family answers:

- `family`: its name (config.json's model_type), the key of its entries in the registries
  (tessera/config/vision_families.py: the recipe for a new family);
- `image_input(image)`: one image of a served prompt (the image processor's output) checked, with
  the number of placeholders it takes and its patch grid (None for a fixed-size image);
- `image_part_ids()`: the token ids a chat's image part is written as, before the placeholders
  are widened (one image token; Qwen's between its vision start and end tokens);
- `rope_positions(input_ids, grids)`: the rotary positions a prompt with images takes when the
  family computes its own (Qwen's M-RoPE), else None (the language model's 0..S-1);
- `part_modules(part)` and `unused_tower_modules()`: what the trainer's freeze switches name
  ("vision_tower", "projector", "language_model"), and the tower's modules no forward runs.

Training layouts reach a model through its `sequence` seam (a `RowSequence`; context and sequence
parallelism install `RankRows`, tessera.parallel.vision_language): the whole sequence's ids from
the ones this rank holds, this rank's rows of the merged embeddings, and its positions of the
whole rows' rotary positions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from tessera.config.errors import ModelError
from tessera.models.mtp import TokenSequence
from tessera.models.norm import RMSNorm
from tessera.models.transformer import Transformer, init_by_name


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


class ImageInput(NamedTuple):
    """One image of a served prompt as the engine queues it (`VisionLanguageModel.image_input`)."""

    pixels: Any  # np.ndarray: the image processor's output (LLaVA [C, H, W]; Qwen its patch rows)
    tokens: int  # the placeholders it takes in the prompt (= its feature rows)
    grid: tuple[int, int, int] | None  # (t, h, w) patches of a native-resolution image; None: fixed size


class VisionLanguageModel(nn.Module):
    """What the vision-language families share (module docstring); each family's class implements
    the seam and the answers."""

    cfg: Any  # the family's config (LlavaConfig, QwenVLConfig): text, vision, image_token_id, family
    language_model: Transformer

    @property
    def family(self) -> str:
        """The family's name: config.json's model_type ("llava", "qwen2_vl", "qwen2_5_vl")."""
        return self.cfg.family

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    def image_input(self, image: Any) -> ImageInput:
        """Image `image` of a served prompt (the image processor's output), checked: a ConfigError
        names what this family takes."""
        raise NotImplementedError

    def image_part_ids(self) -> list[int]:
        """The token ids of one image part of a chat, before its placeholders are widened."""
        return [self.cfg.image_token_id]

    def rope_positions(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
        """Rotary positions [3, B, S] of a prompt when the family computes its own; None: 0..S-1."""
        return None

    def part_modules(self, part: str) -> list[nn.Module]:
        """The modules of `part` ("vision_tower", "projector" or "language_model"): by default the
        attribute of that name."""
        return [getattr(self, part)]

    def unused_tower_modules(self) -> list[nn.Module]:
        """The tower's modules no forward runs (they get no gradient, so they hold no optimizer state)."""
        return []

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

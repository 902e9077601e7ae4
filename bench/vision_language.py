"""LLaVA serving on the CPU: time to first token of a request whose image was seen before against a
new image, and the vision encoder's images per second.

    python bench/vision_language.py [--rounds 7] [--image-size 336] [--patch 14] [--vision-layers 6]

A LLaVA of random weights is built in memory (a CLIP tower of `--image-size`/`--patch` with
`--vision-layers` blocks, and a small Llama) and served by `LLM`'s engine with the prefix cache on.
Each round, one after the other so that the machine's load falls on all alike:

    new image     a prompt with an image the engine has not seen: the tower, the projector and the
                  whole prompt run
    seen image    the same prompt and image again: its KV blocks come from the prefix cache
    seen, other   the same image after other text: its encoder output comes from the encoder cache,
                  the prompt runs

Each is the time until the first token (one step of `max_tokens=1`). The encoder alone is timed on
a batch of `--batch` images (`encode_images`), alternating round by round with the same model
exported (`save_llava`) and loaded by transformers' `LlavaForConditionalGeneration`, timed on its
`get_image_features` (the tower, the feature layers and the projector: the same work), whose
outputs are checked equal first. Prints one JSON object: medians over rounds, the ratios to a new
image, the encoder's images per second and its ratio to transformers' in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.checkpoint.hf.llava import save_llava  # noqa: E402
from tessera.config.model import ModelConfig  # noqa: E402
from tessera.config.vision import LlavaConfig, VisionConfig  # noqa: E402
from tessera.infer import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tessera.models.vision.llava import Llava  # noqa: E402


def build(args) -> Llava:
    text = ModelConfig(family="llama", vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376,
                       max_seq_len=2048)
    vision = VisionConfig(image_size=args.image_size, patch_size=args.patch, dim=512, n_layers=args.vision_layers,
                          n_heads=8, ffn_dim=2048)
    return Llava(LlavaConfig(text=text, vision=vision, image_token_id=4095), init_seed=0).eval()


def first_token_s(engine: LLMEngine, prompt: list[int], pixels: np.ndarray) -> float:
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), images=[pixels])
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def encoder_rounds(model: Llava, batch: torch.Tensor, rounds: int) -> tuple[list[float], list[float], float]:
    """Seconds per `batch` of Tessera's encoder and of transformers' on the same weights, alternated."""
    from transformers import LlavaForConditionalGeneration

    with tempfile.TemporaryDirectory() as tmp:
        save_llava(model, tmp)
        peer = LlavaForConditionalGeneration.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    cfg = peer.config

    def theirs() -> torch.Tensor:
        out = peer.model.get_image_features(pixel_values=batch, vision_feature_layer=cfg.vision_feature_layer,
                                            vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        return torch.stack(list(out.pooler_output if hasattr(out, "pooler_output") else out))

    times, peer_times = [], []
    with torch.inference_mode():
        max_diff = (torch.stack(model.encode_images(batch)) - theirs()).abs().max().item()
        for _ in range(rounds):
            start = time.perf_counter()
            model.encode_images(batch)
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            theirs()
            peer_times.append(time.perf_counter() - start)
    return times, peer_times, max_diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--image-size", type=int, default=336)
    p.add_argument("--patch", type=int, default=14)
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    model = build(args)
    engine = LLMEngine.from_model(model, EngineConfig(block_size=16, max_num_batched_tokens=2048,
                                                      mm_encoder_cache_images=4 * args.rounds + 4))
    rng = np.random.default_rng(0)
    side = args.image_size

    def image() -> np.ndarray:
        return rng.standard_normal((3, side, side)).astype(np.float32)

    text = list(range(10, 74))
    prompt = text + [4095] + text
    first_token_s(engine, prompt, image())  # warm-up
    new, seen, other = [], [], []
    for r in range(args.rounds):
        pic = image()
        new.append(first_token_s(engine, prompt, pic))
        seen.append(first_token_s(engine, prompt, pic))
        other.append(first_token_s(engine, [100 + r] + prompt, pic))
    batch = torch.from_numpy(np.stack([image() for _ in range(args.batch)]))
    times, peer_times, max_diff = encoder_rounds(model, batch, args.rounds)
    med = {k: statistics.median(v) for k, v in (("new_image_ttft_s", new), ("seen_image_ttft_s", seen),
                                                  ("seen_image_other_text_ttft_s", other))}
    print(json.dumps({
        **med,
        "seen_over_new": med["seen_image_ttft_s"] / med["new_image_ttft_s"],
        "seen_other_text_over_new": med["seen_image_other_text_ttft_s"] / med["new_image_ttft_s"],
        "encoder_images_per_s": args.batch / statistics.median(times),
        "encoder_speed_over_transformers": statistics.median(peer_times) / statistics.median(times),
        "encoder_max_abs_diff_vs_transformers": max_diff,
        "image_tokens": model.cfg.image_tokens, "prompt_tokens": len(prompt) - 1 + model.cfg.image_tokens,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "args": vars(args),
    }, indent=2))


if __name__ == "__main__":
    main()

"""Weight quantization at load (`--quantization`) and pre-quantized checkpoints: perplexity on
held-out text and resident weight memory of a small model trained on the bundled corpus, for none /
int8 / fp8 / int4 at load, and for the pre-quantized directories Tessera loads kept quantized.

    python bench/quantization.py [--steps 300] [--tokens 4096] [--out DIR] [--no-prequantized]

One run of tiny-dense widened to dim 128, ffn 384 (so int4's groups are the full 128 inputs of
every block linear) trained `--steps` steps on the bundled corpus (stdlib source, the bundled
tokenizer), then served by the engine once per method. The held-out text is stdlib source the
corpus never holds (the files after its `max_bytes` cut), its first `--tokens` tokens. Memory is
counted from the served model's tensors: the quantized block linears (codes + scales; for "none"
the same layers' full-precision weights), and every weight of the model (embedding, norms and head
included, which no method quantizes).

Pre-quantized directories (tessera/checkpoint/prequantized): the trained model is exported to a
HuggingFace directory, read by transformers and quantized by the compressed-tensors library
(tests/checkpoint/quantized_checkpoints.py: W4A16 and W8A16 in groups of 128, W8A8 int8 with
dynamic per-token or static per-tensor activations, FP8 per channel with dynamic per-token or per
tensor with static activations; static scales from 512 tokens of the training corpus, weight
scales by min/max) or written as DeepSeek-V3 block FP8 (128 x 128 blocks), then each directory is
served by the engine as it is. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.checkpoint.hf.writer import save_pretrained  # noqa: E402
from tessera.config.schema import load_config  # noqa: E402
from tessera.data.corpus import DEFAULT_CORPUS_BYTES, select_stdlib_files  # noqa: E402
from tessera.infer import EngineConfig, LLMEngine  # noqa: E402
from tessera.infer.engine.perplexity import perplexity  # noqa: E402
from tessera.models.int8 import quantizable_layers  # noqa: E402
from tessera.train.trainer import Trainer  # noqa: E402

CONFIG = str(ROOT / "configs" / "tiny-dense.yaml")
MODEL = ("model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384")
TRAIN = ("train.device=cpu", "train.seq_len=128", "train.micro_batch_size=8", "train.global_batch_size=8",
         "log.tensorboard=false", "log.progress_bar=false", "checkpoint.keep_last=1", "train.log_interval=50",
         "optim.lr=2e-3", "optim.min_lr=2e-4", "optim.warmup_steps=20", "train.eval_interval=0")


def train_and_export(config: str, model: tuple[str, ...], out: Path, steps: int) -> tuple[dict, float, Path]:
    """Train `config` with `model`'s and TRAIN's settings for `steps` into out/run, then export it as a
    HuggingFace directory out/hf: (the last step's record, training seconds, that directory)."""
    from tessera.checkpoint.convert import convert

    run_dir = out / "run"
    cfg = load_config(config, [*model, *TRAIN, f"run_dir={run_dir}", f"train.steps={steps}",
                               f"checkpoint.interval={steps}"])
    start = time.perf_counter()
    last = Trainer(cfg).train().records[-1]
    train_s = time.perf_counter() - start
    convert(run_dir, out / "hf")
    return last, train_s, out / "hf"


def held_out_text(max_chars: int) -> str:
    """Standard-library source after the corpus's cut (never trained on), up to `max_chars`."""
    corpus = set(select_stdlib_files(DEFAULT_CORPUS_BYTES))
    text = ""
    for path in select_stdlib_files(10**10):
        if path not in corpus:
            text += path.read_text(encoding="utf-8", errors="replace")
            if len(text) >= max_chars:
                break
    return text[:max_chars]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


PREQUANTIZED = ("w4a16", "w8a16", "w8a8_dynamic", "w8a8_static", "fp8_channel_dynamic", "fp8_tensor_static",
                "block_fp8")


def corpus_text(max_chars: int) -> str:
    """The training corpus's first `max_chars` characters (calibration text for static scales)."""
    text = ""
    for path in select_stdlib_files(DEFAULT_CORPUS_BYTES):
        text += path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= max_chars:
            break
    return text[:max_chars]


def prequantized_dirs(model, tokenizer, out: Path) -> dict[str, Path]:
    """The served model exported to HuggingFace, then one pre-quantized directory per format."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.checkpoint.quantized_checkpoints import compress, save_block_fp8

    save_pretrained(model, out / "hf", tokenizer="default")
    calib = torch.tensor(tokenizer.encode(corpus_text(8192))[:512]).reshape(4, 128)
    dirs = {}
    for kind in PREQUANTIZED:
        hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
        dirs[kind] = out / kind
        if kind == "block_fp8":
            save_block_fp8(hf, dirs[kind], (128, 128))
        else:
            compress(hf, dirs[kind], kind, calib, group_size=128)
    return dirs


def measure(run_dir: Path, method: str | None, token_ids: list[int], names: list[str]) -> dict:
    engine = LLMEngine.from_dir(run_dir, EngineConfig(quantization=method, block_size=16, num_blocks=64))
    model = engine.model
    start = time.perf_counter()
    ppl = perplexity(engine, token_ids, chunk=128)
    wall = time.perf_counter() - start
    return {"perplexity": ppl, "eval_wall_s": wall,
            "block_linear_bytes": nbytes(t for n in names for t in model.get_submodule(n).state_dict().values()),
            "all_weight_bytes": nbytes(model.state_dict().values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--out", default=None, help="where the run goes (default: a temporary directory)")
    ap.add_argument("--no-prequantized", action="store_true", help="skip the pre-quantized directories")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.out or tmp) / "run"
        cfg = load_config(CONFIG, [*MODEL, *TRAIN, f"run_dir={run_dir}", f"train.steps={args.steps}",
                                   f"checkpoint.interval={args.steps}"])
        start = time.perf_counter()
        last = Trainer(cfg).train().records[-1]
        train_s = time.perf_counter() - start
        probe = LLMEngine.from_dir(run_dir, EngineConfig(block_size=16, num_blocks=64))
        token_ids = probe.tokenizer.encode(held_out_text(args.tokens * 8))[:args.tokens]
        names = [n for n, _ in quantizable_layers(probe.model)]
        dirs = {} if args.no_prequantized else prequantized_dirs(probe.model, probe.tokenizer, run_dir.parent)
        del probe
        results = {str(m): measure(run_dir, m, token_ids, names) for m in (None, "int8", "fp8", "int4")}
        results.update({f"prequantized {kind}": measure(d, None, token_ids, names) for kind, d in dirs.items()})
    base = results["None"]
    for r in results.values():
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        r["block_linear_bytes_ratio"] = r["block_linear_bytes"] / base["block_linear_bytes"]
    print(json.dumps({"machine": platform.machine(), "train": {"steps": args.steps, "loss_last": last["loss"],
                                                               "wall_s": train_s},
                      "held_out_tokens": len(token_ids), "quantized_layers": len(names), "methods": results,
                      "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()

"""Peak memory of exporting a Tessera checkpoint to HuggingFace: streamed vs whole model.

    python bench/hf_export_memory.py [--dim 512 --layers 8 --experts 8 --vocab 32000 --shard-mib 64]

Writes a one-process checkpoint of an MoE model, then exports it twice, each in a fresh process
so that their peak resident memory (max RSS) is their own: `streamed` is `tessera convert`'s path
(`export_checkpoint_to_hf`: one safetensors file's tensors read, written and released at a time),
`whole` loads the whole model first and calls `save_pretrained` (what one-process export costs).
Both write the same files (compared byte for byte). Prints one JSON object: seconds, max RSS, the
tensor bytes the streamed export held at once, the model's bytes, and the RSS of a process that only
imports torch and Tessera (the floor both pay). Linux (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(mode: str, ckpt: str, out: str, shard_mib: int) -> None:
    import torch  # noqa: F401  (the import floor is part of every mode)

    from tessera.checkpoint.dcp.model import load_tessera_model
    from tessera.checkpoint.hf.export import export_checkpoint_to_hf
    from tessera.checkpoint.hf.writer import save_pretrained

    t0 = time.perf_counter()
    extra = {}
    if mode == "streamed":
        r = export_checkpoint_to_hf(ckpt, out, max_shard_bytes=shard_mib << 20)
        extra = {"held_at_once_mib": round(r.peak_bytes / 2**20, 1), "model_mib": round(r.total_bytes / 2**20, 1)}
    elif mode == "whole":
        model, _ = load_tessera_model(ckpt)
        save_pretrained(model, out, max_shard_bytes=shard_mib << 20)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 2), "max_rss_mib": _peak_rss_mib(), **extra}))


def _peak_rss_mib() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not carried over from the
    parent through fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-mib", type=int, default=64)
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        mode, ckpt, out, shard = a.child
        return _child(mode, ckpt, out, int(shard))
    from tessera.checkpoint.dcp.model import save_model_checkpoint
    from tessera.config.schema import load_config
    from tessera.models import Transformer

    root = Path(tempfile.mkdtemp(prefix="tessera-export-bench-"))
    cfg = load_config(Path(__file__).parents[1] / "configs/tiny-moe.yaml",
                      [f"model.dim={a.dim}", "model.n_heads=8", f"model.n_layers={a.layers}",
                       f"model.moe.ffn_dim={2 * a.dim}", f"model.moe.num_experts={a.experts}",
                       f"model.vocab_size={a.vocab}"])
    try:
        model = Transformer(cfg.model, init_seed=0)
        params = sum(p.numel() for p in model.parameters())
        save_model_checkpoint(model, root / "ckpt", tokenizer=None)
        del model
        ckpt = str(root / "ckpt")
        floor = _run("import", ckpt, str(root / "none"), str(a.shard_mib))
        streamed = _run("streamed", ckpt, str(root / "streamed"), str(a.shard_mib))
        whole = _run("whole", ckpt, str(root / "whole"), str(a.shard_mib))
        same = all(filecmp.cmp(f, root / "whole" / f.name, shallow=False) for f in (root / "streamed").iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"params": params, "shard_mib": a.shard_mib, "import_only_max_rss_mib": floor["max_rss_mib"],
                      "streamed": streamed, "whole": whole, "same_files": same}))


if __name__ == "__main__":
    main()

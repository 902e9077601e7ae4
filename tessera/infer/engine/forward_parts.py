"""The serving split inside a recorded engine step's forward (`tessera serve --profile-dir`,
step_profile.py): where the executor's time went, per step, in seconds.

    attention_s    the attention modules (their projections, RoPE, the paged attention itself)
    mlp_s          the MLP / MoE modules (routed experts included)
    norm_s         the norms outside those modules
    lm_head_s      the output projection
    model_other_s  the rest of the model's forward: embeddings, residual adds, packing the batch
    sampling_s     the rest of the executor: drafting, logits to the host, grammar masks, sampling
    kv_copies_s    copies between KV tiers (host memory, disk) planned for the step

The modules are timed by the training profile's hooks (tessera/train/run/module_marks.py: one kind per
module, a module inside another one timed counted once), installed on this process's model for the
step and removed after it; the model's whole forward is the executor's packed and decode forward
(`forward_split`), its kinds' remainder `model_other_s`. Under tensor parallelism the modules are
rank 0's shard (the other ranks run the same modules at the same time). On a GPU a module's time is
its kernels' (CUDA events), the other parts the host's wall time around them.
"""

from __future__ import annotations

import time
from typing import Any

PARTS = ("attention", "mlp", "norm", "lm_head", "model_other", "sampling", "kv_copies")
_KIND_PART = {"attention": "attention", "mlp": "mlp", "norm": "norm", "loss": "lm_head"}


class ForwardParts:
    """One step's split: `with ForwardParts(executor) as parts: executor.execute_model(plan)`, then
    `parts.split(forward_s)` (the executor's whole time) gives the PARTS in seconds."""

    def __init__(self, executor: Any):
        self.executor = executor
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.model_s = 0.0
        # imported here: the serving engine loads no training module unless a step is recorded
        from tessera.train.run.module_marks import ModuleMarks

        model = getattr(executor, "model", None)
        cuda = model is not None and any(p.is_cuda for p in model.parameters())
        self.marks = ModuleMarks(self._module, cuda=cuda) if model is not None else None
        self.paged = getattr(getattr(executor, "runner", None), "paged", None)

    def _module(self, kind: str, name: str, t0: float, t1: float, **fields: Any) -> None:
        self.seconds[_KIND_PART[name]] += t1 - t0

    def __enter__(self) -> ForwardParts:
        if self.marks is not None:
            self.marks.install([self.executor.model])
        if self.paged is not None and hasattr(self.paged, "forward_split"):
            self.paged.forward_split = self._timed(self.paged.forward_split, "model")
        self.executor.apply_kv_transfers = self._timed(self.executor.apply_kv_transfers, "kv_copies")
        return self

    def __exit__(self, *exc) -> None:
        """The instance attributes dropped (the class's methods again) and the hooks removed."""
        if self.paged is not None:
            self.paged.__dict__.pop("forward_split", None)
        self.executor.__dict__.pop("apply_kv_transfers", None)
        if self.marks is not None:
            self.marks.remove()  # on a GPU this writes the modules' kernel times

    def _timed(self, method, part: str):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if part == "model":
                    self.model_s += time.perf_counter() - t0
                else:
                    self.seconds[part] += time.perf_counter() - t0

        return call

    def split(self, forward_s: float) -> dict[str, float]:
        """`{part}_s` for every PART; they add up to `forward_s` (a part cannot go below 0)."""
        kinds = sum(self.seconds[p] for p in ("attention", "mlp", "norm", "lm_head"))
        self.seconds["model_other"] = max(self.model_s - kinds, 0.0)
        self.seconds["sampling"] = max(forward_s - self.model_s - self.seconds["kv_copies"], 0.0)
        return {f"{p}_s": self.seconds[p] for p in PARTS}

"""bench/quant_kernels.py's two paths on a tiny model: "kernel" serves through the codes where they lie
at every quantized layer, "reference" with every seam cleared, and they give the same greedy texts
(what the bench times is the same computation) and hold the same weight bytes (the kernel keeps nothing
beside the codes); its timings live in docs/benchmarks.md."""

from __future__ import annotations

import pytest
import torch

from bench.quant_kernels import measure
from tessera.infer.cpu import attention as cpu_attention
from tests.infer.tiny_models import write_model


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_bench_times_both_paths_of_the_same_model(method, tmp_path, monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_attention.kernel() is not None, "the CPU kernels did not build (see the log)"
    write_model(tmp_path, intermediate_size=64)
    threads = torch.get_num_threads()
    try:  # measure() pins one thread, as the bench's child processes run
        kernel = measure(str(tmp_path), method, "kernel", 6, [1, 2])
        reference = measure(str(tmp_path), method, "reference", 6, [1, 2])
    finally:
        torch.set_num_threads(threads)
    assert kernel["layers"] == kernel["with_kernel"] == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    assert kernel["weight_mib"] == reference["weight_mib"] > 0 and kernel["vmrss_trimmed_mib"] > 0
    for b in (1, 2):
        assert kernel[f"batch{b}_tokens_per_s"] > 0 and reference[f"batch{b}_tokens_per_s"] > 0
        assert kernel[f"batch{b}_texts"] == reference[f"batch{b}_texts"] and len(kernel[f"batch{b}_texts"]) == b

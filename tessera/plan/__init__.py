"""Layer 8: analytic estimates of a training run (memory, FLOPs, pipeline bubble, communication,
step time) for any model x layout x cluster, a search for the best layout, and the start-up
memory check. See docs/planning.md. Nothing here imports torch except `saved_tensors`, the
instrument the estimates are tested with."""

from tessera.plan.cluster import Cluster, parse_bytes, parse_rate
from tessera.plan.estimate import Plan, make_plan, precisions_for_train_dtype
from tessera.plan.fits import check_fits
from tessera.plan.gpus import GPUS, GpuSpec, get_gpu
from tessera.plan.layout import Layout, Workload, check_layout, layout_problems
from tessera.plan.profile import ModelProfile
from tessera.plan.search import SearchResult, enumerate_layouts, search

__all__ = [
    "GPUS", "GpuSpec", "get_gpu",
    "Cluster", "Layout", "ModelProfile", "Plan", "SearchResult", "Workload", "check_fits", "check_layout",
    "enumerate_layouts", "layout_problems", "make_plan", "parse_bytes", "parse_rate", "precisions_for_train_dtype",
    "search",
]

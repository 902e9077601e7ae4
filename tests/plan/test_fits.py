"""The start-up check the trainer calls before allocating."""

from __future__ import annotations

from tessera.config import get_preset
from tessera.config.parallel import ParallelConfig
from tessera.plan.fits import check_fits


def test_a_run_that_fits_gets_no_message():
    cfg = get_preset("tiny-llama")
    assert check_fits(cfg, ParallelConfig(), 256, 4, 16, 1, "80GiB") is None
    assert check_fits(cfg, ParallelConfig(), 256, 4, 16, 1, 8 * 2**30, dtype="fp32") is None


def test_a_run_that_does_not_fit_says_by_how_much_and_what_would():
    cfg = get_preset("llama3-8b")
    message = check_fits(cfg, ParallelConfig(zero_stage=1), 8192, 2, 64, 8, "80GiB")
    assert message is not None
    assert "needs about" in message and "GiB" in message and "activations" in message
    assert "with zero_stage=3" in message or "recompute=full" in message


def test_a_run_too_big_for_any_cheap_change_points_to_the_search():
    cfg = get_preset("llama3-70b")
    message = check_fits(cfg, ParallelConfig(), 4096, 1, 8, 8, "80GiB")
    assert message is not None and "--search" in message


def test_a_layout_that_cannot_run_is_reported_not_raised():
    cfg = get_preset("llama3-8b")
    message = check_fits(cfg, ParallelConfig(tp=3, dp_shard=1), 4096, 1, 8, 3, "80GiB")
    assert message is not None and "tp=3 does not divide model.n_heads=32" in message
    assert "gpu_memory" in check_fits(cfg, ParallelConfig(), 4096, 1, 8, 8, "lots")

"""`tessera plan CONFIG --gpus N`: the command, run on real YAML files."""

from __future__ import annotations

import json

import pytest
import yaml

from tessera.cli import main as tessera_main
from tessera.config import get_preset
from tessera.models.counting import count_params
from tessera.models.flops import flops_per_token


def main(argv: list[str]) -> int:
    """`tessera plan ARGV`."""
    return tessera_main(["plan", *argv])


def write_config(tmp_path, model, parallel, seq_len=8192, micro_batch=1, global_batch=512, dtype="bf16"):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": model, "parallel": parallel,
                                    "train": {"seq_len": seq_len, "micro_batch_size": micro_batch,
                                              "global_batch_size": global_batch, "dtype": dtype}}))
    return str(path)


def test_plan_of_a_real_size_model_on_64_gpus_prints_the_breakdown(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"tp": 2, "sp": True, "dp_shard": -1, "zero_stage": 1})
    assert main([path, "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    for text in ("8.03 B total", "tp2+sp pp1 shard32(zero1)", "Memory per rank", "optimizer state",
                 "activations (in flight)", "FITS", "FLOPs per step", "Pipeline bubble", "Communication per step",
                 "reduce-scatter", "Step time", "MFU"):
        assert text in out, text


def test_json_output_carries_the_same_numbers(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "mixtral-8x7b"},
                        {"pp": 4, "pp_schedule": "interleaved_1f1b", "vpp": 2, "dp_shard": -1, "ep": 8,
                         "recompute": "full"},
                        seq_len=4096, global_batch=256)
    assert main([path, "--gpus", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    cfg = get_preset("mixtral-8x7b")
    assert plan["model"]["params_active"] == count_params(cfg, active=True) < plan["model"]["params_total"]
    assert plan["flops"]["model_per_step"] == pytest.approx(flops_per_token(cfg, 4096) * 4096 * 256)
    assert plan["pipeline"]["bubble_fraction"] == pytest.approx(3 / (2 * 16))
    groups = {c["group"] for c in plan["communication"]}
    assert {"ep", "pp", "dp_shard"} <= groups
    assert len(plan["memory"]["stages"]) == 4


def test_search_proposes_a_layout_with_reasons(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {})
    assert main([path, "--gpus", "64", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts" in out and "Why:" in out and "parallel section of the best layout" in out
    assert "  1. " in out and "  3. " in out and "Best layout in detail" in out


def test_a_run_that_does_not_fit_exits_1(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-70b"}, {"dp_replicate": 8, "dp_shard": 1})
    assert main([path, "--gpus", "8"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_cluster_flags_change_the_plan(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"dp_shard": -1})
    main([path, "--gpus", "16", "--json"])
    slow = json.loads(capsys.readouterr().out)
    main([path, "--gpus", "16", "--json", "--gpu-memory", "141GB", "--inter-node-bandwidth", "400GB/s",
          "--gpu-flops", "1979e12", "--set", "train.global_batch_size=256"])
    fast = json.loads(capsys.readouterr().out)
    assert fast["memory"]["usable_bytes"] > slow["memory"]["usable_bytes"]
    assert fast["time"]["total"] < slow["time"]["total"]
    assert fast["workload"]["global_batch"] == 256


def test_bad_input_exits_2_with_the_key(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"tp": 3, "dp_shard": -1})
    assert main([path, "--gpus", "6", "--gpus-per-node", "6"]) == 2
    assert "tp=3 does not divide model.n_heads=32" in capsys.readouterr().err
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"tensor": 2})
    assert main([path, "--gpus", "8"]) == 2
    assert "parallel.tensor" in capsys.readouterr().err
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {})
    assert main([path, "--gpus", "8", "--gpu-memory", "lots"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err


def test_microbatches_must_agree_with_the_batch(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"dp_shard": -1, "microbatches": 3})
    assert main([path, "--gpus", "64"]) == 2
    assert "parallel.microbatches=3" in capsys.readouterr().err


def test_gpu_preset_and_json_contract(tmp_path, capsys):
    """`--gpu NAME --json`: time.tokens_per_second for the whole cluster and time.mfu against the GPU's peak."""
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"dp_shard": -1, "recompute": "full"}, global_batch=64)
    plans = {}
    for gpu in ("a100", "h100", "h200"):
        assert main([path, "--gpus", "16", "--gpu", gpu, "--set", "train.micro_batch_size=1", "--json"]) == 0
        plans[gpu] = json.loads(capsys.readouterr().out)
    for gpu, plan in plans.items():
        t = plan["time"]
        assert t["tokens_per_second"] == pytest.approx(64 * 8192 / t["total"])
        peak = plan["cluster"]["gpu_flops"]
        assert t["mfu"] == pytest.approx(plan["flops"]["model_per_step"] / (t["total"] * 16 * peak))
        assert plan["cluster"]["gpu"] == gpu
    assert plans["h200"]["cluster"]["gpu_memory"] > plans["h100"]["cluster"]["gpu_memory"]
    assert plans["a100"]["time"]["tokens_per_second"] < plans["h100"]["time"]["tokens_per_second"]
    with pytest.raises(SystemExit) as exit_:
        main([path, "--gpus", "16", "--gpu", "v100"])
    assert exit_.value.code == 2 and "a100" in capsys.readouterr().err


def test_search_json_best_parallel_mapping_is_what_the_trainer_takes(tmp_path, capsys):
    from tests.plan.test_layout_validity import as_overrides, trainer_refusal

    assert main(["configs/tiny-moe.yaml", "--gpus", "4", "--search", "--top", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    best = result["best"]
    assert best["parallel"] == result["ranked"][0]["parallel"] and "reason" in best and best["against_other_shapes"]
    assert set(best["parallel"]) <= {"tp", "sp", "pp", "vpp", "pp_schedule", "dp_replicate", "dp_shard", "cp", "ep",
                                     "cp_method", "zero_stage", "recompute", "recompute_interval", "recompute_save",
                                     "activation_offload", "activation_fp8", "optimizer", "ep_dispatch_dtype"}
    assert trainer_refusal("configs/tiny-moe.yaml", as_overrides(best["parallel"]), 4) is None
    times = [p["time"]["tokens_per_second"] for p in result["ranked"]]
    assert times == sorted(times, reverse=True)  # ranked by predicted throughput


def test_plan_of_a_huggingface_config(tmp_path, capsys):
    """`model.from_hf`: a HuggingFace model's run is planned from its config.json alone (no weights)."""
    from tessera.config.hf_config import config_to_hf

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config_to_hf(get_preset("llama3-8b"))))
    path = write_config(tmp_path, {"from_hf": str(hf)}, {"tp": 2, "sp": True, "dp_shard": -1, "zero_stage": 1})
    assert main([path, "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "8.03 B total" in out and "dim 4096, 32 layers, 32 heads (8 kv)" in out


def test_a_world_beyond_the_bound_is_refused_at_once_and_large_ones_are_searched(tmp_path, capsys):
    """`--gpus 100000000 --search` enumerated divisors by counting to the world size, for minutes
    without output; the world is bounded (MAX_PARALLEL_SIZE, 2^20 GPUs) and divisors come from
    trial division up to its square root."""
    from tessera.plan.search import divisors

    with pytest.raises(SystemExit) as exit_:
        main(["configs/tiny-moe.yaml", "--gpus", "100000000", "--search"])
    assert exit_.value.code == 2 and "must be an integer in 1..1048576" in capsys.readouterr().err
    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and divisors(97) == [1, 97]
    assert divisors(2**20) == [2**i for i in range(21)]
    assert main(["configs/llama3-8b.yaml", "--gpus", str(2**20), "--search", "--top", "1", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["valid"] > 0  # a million GPUs: layouts exist, and were ranked


def test_efficiency_profiles_megatron_and_tessera(tmp_path, capsys):
    """`--efficiency megatron` (the default, fitted to the calibration runs) or `tessera` (this
    project's kernels: priors, said to be unfitted, since no GPU measurement exists); a number still
    sets the large-GEMM share; anything else exits 2 naming what is allowed."""
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {"dp_shard": -1, "recompute": "full"})
    assert main([path, "--gpus", "8", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main([path, "--gpus", "8", "--efficiency", "megatron", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time"] == default["time"]
    assert main([path, "--gpus", "8", "--efficiency", "tessera"]) == 0
    out = capsys.readouterr().out
    assert "efficiency profile tessera" in out and "UNFITTED" in out
    assert main([path, "--gpus", "8", "--efficiency", "tessera", "--json"]) == 0
    tessera = json.loads(capsys.readouterr().out)
    assert tessera["time"]["total"] > default["time"]["total"]  # FlashAttention-2's share on H100 is lower
    assert main([path, "--gpus", "8", "--efficiency", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time"]["total"] > default["time"]["total"]
    with pytest.raises(SystemExit) as exit_:
        main([path, "--gpus", "8", "--efficiency", "fast"])
    assert exit_.value.code == 2 and "one of megatron, tessera, torch-eager, or a number" in capsys.readouterr().err


def test_search_says_when_it_sampled(tmp_path, capsys):
    path = write_config(tmp_path, {"preset": "llama3-8b"}, {})
    assert main([path, "--gpus", "64", "--search", "--max-layouts", "50", "--top", "1", "--json"]) in (0, 1)
    result = json.loads(capsys.readouterr().out)
    assert result["sampled"] and result["candidates"] > 50 and "uniform sample of 50" in result["coverage"]
    assert main([path, "--gpus", "64", "--search", "--max-layouts", "50", "--top", "1"]) in (0, 1)
    assert "uniform sample of 50" in capsys.readouterr().out

"""A distillation teacher (`train.distill.teacher`) in the planner: every rank holds its frozen weights
(cut by the layout, in the compute copy's bytes, no gradients or optimizer state), pp > 1 is not
planned, and `tessera plan` reads the teacher's shape from its directory."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from tessera.cli import main
from tessera.config import get_preset
from tessera.config.errors import ParallelError
from tessera.models import Transformer
from tessera.plan import Cluster, Layout, Workload, make_plan, search
from tessera.plan.memory import get_precision, teacher_weight_bytes

WORK = Workload(seq_len=256, micro_batch=2, global_batch=8)
STUDENT = dataclasses.replace(get_preset("tiny-llama"), dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
TEACHER = dataclasses.replace(get_preset("tiny-llama"), dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=512)


def _plans(lay: Layout, student=STUDENT, teacher=TEACHER, precision="bf16"):
    cluster = Cluster.for_gpu("h100", gpus=lay.world)
    return (make_plan(student, lay, WORK, cluster, precision=precision),
            make_plan(student, lay, WORK, cluster, precision=precision, teacher=teacher))


@pytest.mark.parametrize("precision,nbytes", [("bf16", 2), ("fp32", 4)])
def test_one_rank_grows_by_every_teacher_weight_in_the_compute_dtype(precision, nbytes):
    without, with_teacher = _plans(Layout(), precision=precision)
    weights = sum(p.numel() for p in Transformer(TEACHER).parameters())  # the real model's parameters
    assert with_teacher.peak.total - without.peak.total == weights * nbytes
    (stage,) = with_teacher.stages
    assert stage.teacher == weights * nbytes
    assert stage.states == without.stages[0].states  # no gradients, master weights or optimizer state added


@pytest.mark.parametrize("sizes", [{"tp": 2}, {"dp_shard": 2}, {"tp": 2, "dp_shard": 2}, {"dp_shard": 2, "cp": 2},
                                   {"dp_shard": 2, "optimizer": "distributed"}, {"dp_shard": 4, "ep": 2}])
def test_the_teacher_is_cut_and_sharded_like_the_weights_of_a_model_of_its_shape(sizes):
    """Per rank the teacher holds what the weights of a student of the teacher's shape would hold under
    the same layout (tp and ep cut, ZeRO-3 sharded over dp_shard x cp), and the plan grows by exactly that."""
    teacher = get_preset("tiny-moe") if "ep" in sizes else TEACHER
    student = dataclasses.replace(teacher, dim=teacher.dim // 2) if "ep" in sizes else STUDENT
    lay = Layout(**sizes)
    without, with_teacher = _plans(lay, student=student, teacher=teacher)
    as_student = make_plan(teacher, lay, WORK, Cluster.for_gpu("h100", gpus=lay.world))
    held = as_student.stages[0].states.weights
    assert teacher_weight_bytes(teacher, lay, get_precision("bf16")) == held
    assert with_teacher.peak.total - without.peak.total == pytest.approx(held, rel=1e-12)
    whole = as_student.params_total * 2
    if lay.optimizer == "distributed":  # every rank holds every weight; only optimizer state is sharded
        assert held == whole
    else:  # the other layouts cut or shard it
        assert held < whole


def test_a_teacher_is_planned_at_pp_1_only():
    with pytest.raises(ParallelError, match="train.distill.teacher.*pp=1 only, got pp=2"):
        _plans(Layout(pp=2))
    cluster = Cluster.for_gpu("h100", gpus=4)
    result = search(STUDENT, WORK, cluster, teacher=TEACHER)
    assert result.ranked and all(p.layout.pp == 1 and p.teacher is TEACHER for p in result.ranked)
    assert any(p.layout.pp > 1 for p in search(STUDENT, WORK, cluster).ranked)


def test_tessera_plan_counts_the_teacher_of_the_config(tmp_path, capsys):
    teacher_dir = tmp_path / "teacher"
    hf = LlamaConfig(vocab_size=STUDENT.vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    hf.save_pretrained(teacher_dir)  # the shape is all the planner reads
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"preset": "tiny-llama", "dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256},
        "train": {"seq_len": 256, "micro_batch_size": 2, "global_batch_size": 8, "dtype": "bf16"}}))
    assert main(["plan", str(config), "--gpus", "1", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)["memory"]
    assert main(["plan", str(config), "--gpus", "1", "--json", "--set", f"train.distill.teacher={teacher_dir}"]) == 0
    with_teacher = json.loads(capsys.readouterr().out)["memory"]
    assert "teacher_weights" not in without["stages"][0]
    teacher_params = LlamaForCausalLM(hf).num_parameters()  # transformers' count of the teacher
    assert with_teacher["stages"][0]["teacher_weights"] == teacher_params * 2
    assert with_teacher["peak_bytes"] - without["peak_bytes"] == teacher_params * 2
    assert main(["plan", str(config), "--gpus", "1", "--set", f"train.distill.teacher={teacher_dir}"]) == 0
    assert "teacher weights (frozen)" in capsys.readouterr().out
    assert main(["plan", str(config), "--gpus", "2", "--set", "parallel.pp=2",
                 "--set", f"train.distill.teacher={teacher_dir}"]) == 2

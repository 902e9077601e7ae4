"""A distillation teacher (`train.distill.teacher`) in the planner: every rank holds its frozen weights
(cut by the layout, in the compute copy's bytes, no gradients or optimizer state), each pipeline
stage its layers and the teacher's hidden states in flight, and `tessera plan` reads the teacher's
shape from its directory."""

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


@pytest.mark.parametrize("sizes,student_layers", [({"pp": 2}, 2), ({"pp": 2, "dp_shard": 2}, 2),
                                                  ({"pp": 2, "vpp": 2, "pp_schedule": "interleaved_1f1b"}, 4)])
def test_under_pp_each_stage_holds_its_teacher_layers_and_their_hidden_states_in_flight(sizes, student_layers):
    """Each stage holds the weights a student of the teacher's shape would hold on that stage, and
    every stage but the first the teacher's hidden states received per micro-batch in flight."""
    lay = Layout(**sizes)
    without, with_teacher = _plans(lay, student=dataclasses.replace(STUDENT, n_layers=student_layers))
    as_student = make_plan(TEACHER, lay, WORK, Cluster.for_gpu("h100", gpus=lay.world))
    weights = [s.states.weights for s in as_student.stages]
    assert [teacher_weight_bytes(TEACHER, lay, get_precision("bf16"), s) for s in range(lay.pp)] == weights
    assert sum(weights) < sum(teacher_weight_bytes(TEACHER, Layout(dp_shard=lay.dp_shard), get_precision("bf16"))
                              for _ in range(lay.pp))  # cut over the stages
    for s, (a, b) in enumerate(zip(without.stages, with_teacher.stages, strict=True)):
        hidden = 0 if s == 0 else b.activations.in_flight * WORK.micro_batch * WORK.seq_len * TEACHER.dim * 4
        assert b.activations.in_flight >= 1
        assert b.teacher == pytest.approx(weights[s] + hidden, rel=1e-12)  # autocast-bf16: fp32 residual
        assert b.total - a.total == pytest.approx(b.teacher, rel=1e-12)


def test_a_teacher_with_fewer_layers_than_stages_is_refused_and_not_searched():
    shallow = dataclasses.replace(TEACHER, n_layers=1)
    with pytest.raises(ParallelError, match="train.distill.teacher.*has 1 layers, fewer than the 2 pipeline stages"):
        _plans(Layout(pp=2), teacher=shallow)
    cluster = Cluster.for_gpu("h100", gpus=4)
    result = search(STUDENT, WORK, cluster, teacher=shallow)
    assert result.ranked and all(p.layout.pp == 1 and p.teacher is shallow for p in result.ranked)
    assert any(p.layout.pp > 1 for p in search(STUDENT, WORK, cluster, teacher=TEACHER).ranked)


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
    assert main(["plan", str(config), "--gpus", "2", "--json", "--set", "parallel.pp=2",
                 "--set", f"train.distill.teacher={teacher_dir}"]) == 0
    stages = json.loads(capsys.readouterr().out)["memory"]["stages"]
    assert [s["teacher_weights"] > 0 for s in stages] == [True, True]  # each stage its share

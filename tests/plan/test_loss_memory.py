"""The planner's memory at the loss equals what the cross-entropy really allocates at its peak.

Each loss runs forward and backward from an LM head's product under torch's profiler, which records
every allocation and free on CPU; the peak of the running sum is what the loss held at once. The
logits dwarf everything else (a wide vocabulary, a narrow hidden size), so the peak is the bytes
per logit of `loss_buffer_bytes_per_logit` plus the 4-byte log-softmax (or softmax) the loss saves,
which the head's saved tensors count (tessera/plan/saved/activation_terms.py). The trainer's loss is
`token_loss_sum` with the logits kept until backward ends, as its step does; torch's is torchtitan's
`cross_entropy(pred.flatten(0, 1).float(), labels)` with `pred` deleted before backward, under
`loss_parallel` when the head is vocabulary-parallel. tp = 2 runs on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

from tessera.config.errors import ConfigError
from tessera.config.presets import get_preset
from tessera.plan.activations import stage_activations
from tessera.plan.layout import Layout, Workload
from tessera.plan.loss_memory import loss_buffer_bytes_per_logit
from tessera.train.objectives.loss import token_loss_sum
from tests.forked_ranks import run_ranks

TOKENS, VOCAB, HIDDEN = 256, 4096, 8
SAVED = 4  # bytes per logit of the saved fp32 log-softmax / softmax
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def peak_bytes(fn) -> int:
    """The most bytes allocated at once while `fn` runs (allocations and frees from torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measured_per_logit(loss: str, dtype: str, tp: int) -> float:
    """Peak bytes per local logit of `loss` from an LM head [TOKENS, HIDDEN] x [VOCAB / tp, HIDDEN]."""
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    hidden = torch.randn(1, TOKENS, HIDDEN, dtype=dt, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, dtype=dt)
    targets = torch.randint(0, VOCAB, (1, TOKENS))
    if tp > 1:
        mesh = init_device_mesh("cpu", (tp,))
        weight = distribute_tensor(weight, mesh, [Shard(0)])
    weight.requires_grad_()

    def head():
        h = DTensor.from_local(hidden, mesh, [Replicate()]) if tp > 1 else hidden
        return F.linear(h, weight)  # sharded on the vocabulary when tp > 1

    def trainer():
        logits = head()
        token_loss_sum(logits, targets).backward()
        del logits  # the trainer's step holds them until its backward is done

    def torchtitan():
        pred = head()
        with loss_parallel() if tp > 1 else torch.enable_grad():
            loss = F.cross_entropy(pred.flatten(0, 1).float(), targets.flatten(0, 1))
            del pred
            loss.backward()

    return peak_bytes(trainer if loss == "tessera" else torchtitan) / (TOKENS * VOCAB / tp)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("loss", ["tessera", "torch"])
def test_one_rank_loss_peak_is_planned(loss, dtype):
    planned = loss_buffer_bytes_per_logit(loss, 1, DTYPES[dtype].itemsize) + SAVED
    assert measured_per_logit(loss, dtype, 1) == pytest.approx(planned, abs=0.05)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("loss", ["tessera", "torch"])
def test_vocabulary_parallel_loss_peak_is_planned(loss, dtype):
    planned = loss_buffer_bytes_per_logit(loss, 2, DTYPES[dtype].itemsize) + SAVED
    for measured in run_ranks(measured_per_logit, 2, loss, dtype, 2):
        assert measured == pytest.approx(planned, abs=0.05)


def test_the_last_stage_holds_the_named_loss_buffer():
    cfg = get_preset("llama3.1-8b")
    work = Workload(seq_len=1024, micro_batch=2, global_batch=2)
    for tp in (1, 8):
        lay = Layout(tp=tp, sp=tp > 1)
        for loss in ("tessera", "torch"):
            acts = stage_activations(cfg, lay, work, "bf16", loss=loss)[-1]
            logits = 2 * 1024 * cfg.vocab_size / tp
            assert acts.logits_buffer == logits * loss_buffer_bytes_per_logit(loss, tp, 2)
    with pytest.raises(ConfigError, match="loss='jax' is invalid: one of tessera, torch"):
        loss_buffer_bytes_per_logit("jax", 1, 2)

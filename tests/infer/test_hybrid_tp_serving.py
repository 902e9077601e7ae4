"""Hybrid models served over two tensor-parallel ranks (CPU, gloo) answer as one rank and as transformers:
each rank's recurrent-state pool holds the states of its own linear-attention or Mamba heads (half the
channels and heads of one rank's), in the slots the driver assigns and sends with every step, so greedy
tokens of requests arriving while others decode, their prompts cut into chunks, equal one rank's and
transformers' for Qwen3.5 (Gated DeltaNet, split projections), Nemotron-H (Mamba-2; and its MoE variant,
each rank half of every relu^2 expert) and Kimi Linear (Kimi delta attention). Prefix-cache snapshots
and speculative drafts rejected on every rank (the driver's KEEP message) leave each rank's slots as one
rank's would be: a shared prefix is taken from the cache and decodes transformers' tokens. The step's
item messages carry the state fields both ways, and a served mixer's parts of its whole weights are sliced
once, again only after an in-place update."""

import copy

import pytest
import torch

from tessera.config import get_preset
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from tessera.infer.runner.paged_model import BatchItem
from tessera.infer.runner.recurrent_step import RecurrentStep
from tessera.infer.runner.tensor_parallel import KeptParts
from tessera.infer.runner.tp_channel import _unpack_items, pack_items
from tessera.infer.scheduling.recurrent_state import RecurrentStatePool, bytes_per_slot
from tests.infer.tiny_models import hf_greedy
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 40]]
# a budget of 8 tokens a step: the long prompts prefill in chunks beside the others' decodes
OPTIONS = dict(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)


def _hf_config(family: str):
    """The test config of `family` with every recurrent size divisible by two ranks."""
    cfg = copy.deepcopy(hf_configs()[family])
    if family.startswith("nemotron_h"):
        cfg.n_groups = 2  # 6 heads in 2 groups: 3 heads and their group per rank
    if family == "kimi_linear":
        cfg.linear_num_heads = 2
    return cfg


def _saved(tmp_path_factory, family: str):
    path = tmp_path_factory.mktemp(family) / "hf"
    hf = random_hf_model(_hf_config(family), seed=3, std=0.2)
    hf.save_pretrained(path)
    return path, hf


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "kimi_linear", "nemotron_h_moe"])
def test_two_ranks_serve_a_hybrid_as_one_rank_and_transformers(family, tmp_path_factory, monkeypatch):
    path, hf = _saved(tmp_path_factory, family)
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert [o.token_ids for o in LLM(path, **OPTIONS).generate(PROMPTS, GREEDY)] == want
    steps = []
    init = RecurrentStep.__init__

    def recording(self, pool, segments, device):  # rank 0's steps (the worker runs the same items)
        steps.append([(s.length, s.start) for s in segments])
        init(self, pool, segments, device)

    monkeypatch.setattr(RecurrentStep, "__init__", recording)
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as two:
        engine = two.engine
        ids, done = [], {}
        for prompt in PROMPTS:  # one request a step: later prompts' chunks beside earlier decodes
            ids.append(engine.add_request(prompt, GREEDY))
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        assert [done[i] for i in ids] == want
        pool, whole = engine.executor.local.states, RecurrentStatePool(engine.cfg, 1, torch.float32)
        for layer, fields in pool.tensors.items():  # this rank's heads' states: half of every field's first dim
            assert [t.shape[1] * 2 for t in fields.values()] == [t.shape[1] for t in whole.tensors[layer].values()]
        engine.step()
        assert not engine.runner.slots.owner  # every slot given back
    assert any(start > 0 and n > 1 for step in steps for n, start in step)  # a prompt continued from its state
    assert any(any(n == 1 for n, _ in step) and any(n > 1 for n, _ in step) for step in steps)


@pytest.mark.dist
@pytest.mark.slow
def test_prefix_snapshots_and_rejected_drafts_on_two_ranks_decode_transformers_tokens(tmp_path_factory):
    """Qwen3.5 on two ranks with a snapshot every block and prompt-lookup drafts: a second prompt sharing
    three blocks takes them from the cache (each rank's slot started from its own snapshot), and the
    drafts rejected on every rank leave no trace, so both decode transformers' tokens."""
    path, hf = _saved(tmp_path_factory, "qwen3_5_text")
    shared = [3, 50, 7, 81, 22, 9, 64, 5, 13, 2, 11, 40, 8, 17]
    first, second = shared + [60, 61, 62], shared + [1, 90, 4, 33, 70]
    config = EngineConfig(tensor_parallel_size=2, state_snapshot_tokens=4, **OPTIONS,
                          speculative=SpeculativeConfig(method="prompt_lookup", num_tokens=3))
    engine = LLMEngine.from_dir(path, config)
    try:
        outs = []
        for prompt in (first, second):
            engine.add_request(prompt, GREEDY)
            while engine.has_unfinished():
                outs += [o for o in engine.step() if o.finished]
        assert [o.cached_tokens for o in outs] == [0, 12]
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in (first, second)]
        assert engine.metrics.spec_proposed > engine.metrics.spec_accepted  # drafts rejected, rolled back
    finally:
        engine.close()


def test_a_step_message_carries_each_items_state_slot_drafts_and_snapshots():
    items = [BatchItem([4, 5, 6, 7, 8], 8, [0, 1, 2, 3], state_slot=2, state_from=5, snapshots=((4, 0), (5, 1))),
             BatchItem([9, 10, 11], 3, [4], logits_from=0, window_table=[7], state_slot=0, drafts=2),
             BatchItem([1], 0, [6])]
    got = _unpack_items(pack_items(items))
    assert got == items


def test_each_rank_pays_for_the_states_of_its_own_heads():
    for preset in ("tiny-qwen3.5", "tiny-nemotron-h", "tiny-kimi-linear"):
        cfg = get_preset(preset)
        assert bytes_per_slot(cfg, torch.float32, tp=2) * 2 == bytes_per_slot(cfg, torch.float32)


def test_a_served_mixers_parts_are_read_once_and_again_after_an_in_place_update():
    """KeptParts: a weight's part is sliced the first time and kept; written in place (a GRPO step on
    shared weights), it is sliced again; the input, and any tensor not a parameter, is never kept."""
    reads = []

    def rows(name, t):
        reads.append(name)
        return t[1:3].clone()

    part = KeptParts(rows)
    w = torch.nn.Parameter(torch.arange(8.0).reshape(4, 2), requires_grad=False)
    first = part("in_proj", w)
    assert part("in_proj", w) is first and reads == ["in_proj"]
    with torch.no_grad():
        w.add_(1)
    torch.testing.assert_close(part("in_proj", w), w[1:3])
    x = torch.ones(4, 2)
    part("input", x), part("input", x), part("conv", x), part("conv", x)
    assert reads == ["in_proj", "in_proj", "input", "input", "conv", "conv"] and len(part.kept) == 1

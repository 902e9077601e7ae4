"""Hybrid models served over two tensor-parallel ranks (CPU, gloo) answer as one rank and as transformers:
each rank's recurrent-state pool holds the states of its own linear-attention or Mamba heads (half the
channels and heads of one rank's), in the slots the driver assigns and sends with every step, so greedy
tokens of requests arriving while others decode, their prompts cut into chunks, equal one rank's and
transformers' for Qwen3.5 (Gated DeltaNet, split projections), Nemotron-H (Mamba-2; and its MoE variant,
each rank half of every relu^2 expert) and Kimi Linear (Kimi delta attention). Prefix-cache snapshots
and speculative drafts rejected on every rank (the driver's KEEP message) leave each rank's slots as one
rank's would be: a shared prefix is taken from the cache and decodes transformers' tokens. The step's
item messages carry the state fields both ways. A rank cut for serving holds only its part of the weights
a mixer keeps whole in training (cut at load); an engine over a GRPO trainer's shared weights keeps them
whole, reads its parts once and again only after an in-place update, and so decodes with the update."""

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


def _resident(model) -> int:
    """Bytes the model holds: its parameters and the parts its mixers keep (`KeptParts`), each storage once."""
    tensors = list(model.parameters())
    for module in model.modules():
        if isinstance(getattr(module, "own_part", None), KeptParts):
            tensors += [out for _, _, out in module.own_part.kept.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _serve_cut_and_kept(preset: str) -> dict:
    """On each of two ranks: the model cut for serving (its mixers' whole weights cut at load) and the same
    cut keeping them whole beside the parts it reads (as over a GRPO trainer's shared weights), each after
    a forward of the same ids; their logits of this rank's vocabulary slice and resident bytes."""
    import torch.distributed as dist

    from tessera.infer.runner.tensor_parallel import cut_for_serving, serving_dims, shard_model, to_plain_tensors
    from tessera.models import Transformer
    from tessera.models.linear_attention.gated_deltanet import whole

    cfg = get_preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    dims = serving_dims(cfg, 2)
    dims.build_mesh("cpu")
    group = dims["tp"].get_group()
    with torch.no_grad():
        cut = cut_for_serving(Transformer(cfg, init_seed=0), dims)
        kept = to_plain_tensors(shard_model(Transformer(cfg, init_seed=0).eval(), dims), group)
        logits = {name: m(ids).logits for name, m in (("cut", cut), ("kept", kept))}
    mixers = [m for m in cut.modules() if hasattr(m, "own_part")]
    return {"logits": logits, "resident": {"cut": _resident(cut), "kept": _resident(kept)},
            "cut_reads_whole": all(m.own_part is whole for m in mixers), "rank": dist.get_rank(),
            "mixer_params": {n: tuple(p.shape) for n, p in cut.named_parameters() if ".attention." in n}}


@pytest.mark.dist
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-nemotron-h", "tiny-kimi-linear"])
def test_a_rank_cut_for_serving_holds_only_its_part_of_the_mixers_whole_weights(preset):
    """Served on two ranks, a hybrid's recurrent mixers hold only this rank's part of the weights training
    keeps whole (Qwen3.5's in_proj_qkv rows, Mamba-2's in_proj rows, every conv's channels, the heads'
    A_log / dt_bias / D, Mamba's norm gains): cut at load, half of every such tensor's entries, read as they
    are; the logits equal the cut that keeps them whole and reads its parts through `KeptParts`, which holds
    the whole weights besides (so each rank holds fewer bytes)."""
    from tessera.models import Transformer
    from tests.forked_ranks import run_ranks

    got = run_ranks(_serve_cut_and_kept, 2, preset)
    one = {n: tuple(p.shape) for n, p in Transformer(get_preset(preset), init_seed=0).named_parameters()}
    for rank in got:
        torch.testing.assert_close(rank["logits"]["cut"], rank["logits"]["kept"], rtol=0, atol=0)
        assert rank["cut_reads_whole"]
        assert rank["resident"]["cut"] < rank["resident"]["kept"]
    whole_in_training = [n for n in got[0]["mixer_params"] if n.endswith(WHOLE_IN_TRAINING[preset])]
    for suffix in WHOLE_IN_TRAINING[preset]:
        assert any(n.endswith(suffix) for n in whole_in_training), suffix
    for n in whole_in_training:
        assert got[0]["mixer_params"][n] == got[1]["mixer_params"][n], n
        assert 2 * torch.Size(got[0]["mixer_params"][n]).numel() == torch.Size(one[n]).numel(), n


# the mixers' tensors training keeps whole on every tp rank and reads parts of (parallel/tensor_parallel.py)
WHOLE_IN_TRAINING = {
    "tiny-qwen3.5": ("in_proj_qkv.weight", "conv1d.weight", "A_log", "dt_bias"),
    "tiny-nemotron-h": ("attention.in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "attention.D",
                        "attention.norm.weight"),
    "tiny-kimi-linear": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log", "dt_bias")}


def _shared_then_updated(preset: str) -> dict:
    """On each of two ranks: a serving model over a tp-cut policy's own tensors (GRPO's `alias_shards`),
    its logits before and after the policy's weights move in place, and a model cut for serving afresh
    from the moved weights."""
    import torch.distributed as dist

    from tessera.config.parallel import ParallelConfig
    from tessera.infer.runner.tensor_parallel import cut_for_serving
    from tessera.infer.runner.tp_shared import alias_shards
    from tessera.models import Transformer
    from tessera.parallel import ParallelDims, parallelize
    from tests.parallel.training_step import full_tensors

    cfg = get_preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    dims = ParallelDims.from_config(ParallelConfig(tp=2, dp_shard=1), dist.get_world_size())
    policy = parallelize(Transformer(cfg, init_seed=0), dims, ParallelConfig(tp=2, dp_shard=1))
    served = alias_shards(policy, dims)
    kept = [m.own_part for m in served.modules() if hasattr(m, "own_part")]
    with torch.no_grad():
        before = served(ids).logits
        for p in policy.parameters():  # an optimizer step on the shared weights, in place
            (p.to_local() if hasattr(p, "to_local") else p).mul_(1.05).add_(0.01)
        after = served(ids).logits
        moved = Transformer(cfg, init_seed=None)
        moved.load_state_dict(full_tensors(policy.named_parameters()))
        fresh = cut_for_serving(moved, dims)(ids).logits
    return {"before": before, "after": after, "fresh": fresh, "kept": all(isinstance(k, KeptParts) for k in kept)}


@pytest.mark.dist
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-nemotron-h"])
def test_an_engine_over_a_trainers_shared_weights_reads_their_in_place_updates(preset):
    """GRPO's engine over the trainer's tp shards (`alias_shards`) keeps the mixers' whole weights (they are
    the trainer's) and reads its parts through `KeptParts`: after the weights move in place its logits are
    those of a model cut for serving afresh from the moved weights (which cuts its whole weights at load)."""
    from tests.forked_ranks import run_ranks

    for rank in run_ranks(_shared_then_updated, 2, preset):
        assert rank["kept"]
        assert not torch.allclose(rank["before"], rank["after"])
        torch.testing.assert_close(rank["after"], rank["fresh"], rtol=1e-5, atol=1e-5)


def _gathered_then_updated(preset: str) -> dict:
    """On each of four ranks (tp=2 x dp_shard=2): a GRPO engine's copy of its tp shard of an FSDP policy
    (`gathered_shards`, filled by `gather_shards`), its logits before and after the policy's weights move
    in place (gathered again), a model cut for serving afresh from the moved weights, and the copy's
    mixer parameters' shapes."""
    import torch.distributed as dist

    from tessera.config.parallel import ParallelConfig
    from tessera.infer.runner.tp_shared import gather_shards, gathered_shards
    from tessera.models import Transformer
    from tessera.parallel import ParallelDims, parallelize
    from tests.parallel.training_step import full_tensors

    cfg = get_preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    layout = ParallelConfig(tp=2, dp_shard=2)
    dims = ParallelDims.from_config(layout, dist.get_world_size())
    policy = parallelize(Transformer(cfg, init_seed=0), dims, layout)
    served = gathered_shards(policy, dims)
    with torch.no_grad():
        gather_shards(served, policy)
        before = served(ids).logits
        for p in policy.parameters():  # an optimizer step on the policy's shards, in place
            (p.to_local() if hasattr(p, "to_local") else p).mul_(1.05).add_(0.01)
        gather_shards(served, policy)
        after = served(ids).logits
        moved = Transformer(cfg, init_seed=None)
        moved.load_state_dict(full_tensors(policy.named_parameters()))
        vocab = cfg.vocab_size // 2  # this rank's slice of the one-process logits of the moved weights
        first = dims["tp"].get_local_rank() * vocab
        want = moved(ids).logits[..., first:first + vocab]
    return {"before": before, "after": after, "want": want,
            "mixer_params": {n: tuple(p.shape) for n, p in served.named_parameters() if ".attention." in n}}


@pytest.mark.dist
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-nemotron-h"])
def test_a_grpo_engines_gathered_copy_holds_only_its_part_and_takes_the_updates(preset):
    """Under tp=2 x dp_shard=2 a GRPO engine keeps a copy of its tp shard of the FSDP policy (`gathered_shards`):
    of the weights a mixer keeps whole in training it holds only this rank's part (cut when built), which
    `gather_shards` fills from the policy's whole tensors after each step, so after the weights move its
    logits are the moved model's (this rank's vocabulary slice of one process's)."""
    from tessera.models import Transformer
    from tests.forked_ranks import run_ranks

    got = run_ranks(_gathered_then_updated, 4, preset)
    one = {n: tuple(p.shape) for n, p in Transformer(get_preset(preset), init_seed=0).named_parameters()}
    for rank in got:
        assert not torch.allclose(rank["before"], rank["after"])
        torch.testing.assert_close(rank["after"], rank["want"], rtol=1e-5, atol=1e-5)
        for n, shape in rank["mixer_params"].items():
            if n.endswith(WHOLE_IN_TRAINING[preset]):
                assert 2 * torch.Size(shape).numel() == torch.Size(one[n]).numel(), n

"""Hybrid models (Qwen3-Next: Gated DeltaNet layers beside gated attention; Kimi Linear: Kimi delta
attention beside latent attention without RoPE; Nemotron-H: Mamba-2 layers beside attention and MLP
layers) served by the paged engine, each running sequence's recurrent state in its own slot of the
layout its mixer declares (infer/scheduling/recurrent_state.py):
greedy tokens equal transformers' for requests of different lengths arriving while others decode
(continuous batching, so no state is shared), with prompts cut into chunks (the state carried from
chunk to chunk), under preemption (the state recomputed from the prompt), with speculative drafts
(the state after the accepted ones kept), over HTTP, and from `tessera generate` (over two
tensor-parallel ranks: test_hybrid_tp_serving.py). Every slot comes
back when its request ends, the slots are paid out of the KV budget (prefix caching's snapshots:
tests/infer/test_hybrid_prefix_cache.py),
and the settings a state slot cannot serve (and scoring given tokens past a first chunk) are refused
by name."""

import httpx
import pytest
import torch

from tessera.cli import main
from tessera.config import ConfigError, ModelError, get_preset
from tessera.infer import LLM, EngineConfig, LLMEngine, SamplingParams
from tessera.infer.config import SpeculativeConfig
from tessera.infer.engine.perplexity import paged_nll
from tessera.infer.runner.paged_model import cache_geometry
from tessera.infer.runner.recurrent_step import RecurrentStep, Segment
from tessera.infer.scheduling.kv_cache import bytes_per_block, kv_layers
from tessera.infer.scheduling.recurrent_state import RecurrentStatePool, bytes_per_slot
from tessera.models import Transformer
from tests.hang_guard import HANG_S
from tests.infer.running_server import RunningServer
from tests.infer.tiny_models import char_tokenizer, hf_greedy, save_tokenizer
from tests.models.hf_families import hf_configs, random_hf_model

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 50, 7, 81, 22, 9, 64, 5, 13, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6],
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 40], [60, 4, 77, 31, 31, 2, 90, 65, 12, 44, 20, 19, 7]]


def _saved(tmp_path_factory, family: str):
    """A random transformers model of `family`, saved with the test tokenizer, and its greedy
    completions of PROMPTS."""
    path = tmp_path_factory.mktemp(family) / "hf"
    hf = random_hf_model(hf_configs()[family], seed=3, std=0.2)
    hf.save_pretrained(path)
    save_tokenizer(path)
    return path, hf, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Qwen3-Next: three DeltaNet layers, one attention layer."""
    return _saved(tmp_path_factory, "qwen3_next")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """Kimi Linear: delta attention on layers 0, 2, 3; MLA on 1 and 4; MoE from layer 1."""
    return _saved(tmp_path_factory, "kimi_linear")


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """Nemotron-H: Mamba-2, MLP, attention, Mamba-2, MLP (chunks of 4 tokens in its Mamba layers)."""
    return _saved(tmp_path_factory, "nemotron_h")


@pytest.mark.parametrize("model", ["hybrid", "kimi", "nemotron"])
def test_requests_joining_while_others_decode_equal_transformers(model, request, monkeypatch):
    """Requests arrive one step apart under a budget of 8 tokens: prompt chunks of later ones run in
    the same steps as earlier ones' decodes, each sequence from its own slot."""
    _served_while_others_decode(*request.getfixturevalue(model), monkeypatch)


def _served_while_others_decode(path, hf, want, monkeypatch):
    steps = []
    init = RecurrentStep.__init__

    def recording(self, pool, segments, device):
        steps.append([(s.length, s.start) for s in segments])
        init(self, pool, segments, device)

    monkeypatch.setattr(RecurrentStep, "__init__", recording)
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=4))
    ids, done = [], {}
    for prompt in PROMPTS:
        ids.append(engine.add_request(prompt, GREEDY))
        for out in engine.step():
            done[out.request_id] = out.token_ids
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[i] for i in ids] == want
    chunked = any(start > 0 and n > 1 for step in steps for n, start in step)
    mixed = any(any(n == 1 for n, _ in step) and any(n > 1 for n, _ in step) for step in steps)
    assert chunked and mixed  # a prompt continued from its state; decodes beside a prompt chunk
    slots = engine.runner.slots
    assert list(slots.owner) == [ids[-1]]  # the last to finish is released with the next plan
    engine.step()
    assert not slots.owner and sorted(slots.free) == list(range(4))  # every slot given back


@pytest.mark.parametrize("model", ["hybrid", "kimi", "nemotron"])
def test_preemption_recomputes_the_state_to_the_same_tokens(model, request):
    path, _, want = request.getfixturevalue(model)
    llm = LLM(path, block_size=4, num_blocks=12, max_model_len=40, max_num_seqs=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.metrics.preemptions > 0
    assert [o.token_ids for o in outs] == want


def test_served_over_http_and_by_generate(hybrid, capsys):
    path, hf, _ = hybrid
    tok = char_tokenizer()
    prompt = tok.encode("state", add_special_tokens=False).ids
    with RunningServer(LLMEngine.from_dir(path, EngineConfig(block_size=4)), name="hybrid") as server:
        body = {"model": "hybrid", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, r.text
    assert tok.encode(r.json()["choices"][0]["text"], add_special_tokens=False).ids == hf_greedy(hf, prompt, 6)
    assert main(["generate", str(path), "--prompt", "ab", "--max-new-tokens", "4"]) == 0
    ab = tok.encode("ab", add_special_tokens=False).ids
    assert capsys.readouterr().out.strip() == "ab" + tok.decode(hf_greedy(hf, ab, 4), skip_special_tokens=True)


@pytest.mark.parametrize(("options", "message"), [
    ({"system_prompts": ["You are terse."]}, r"system_prompts is invalid for this model: model.family=qwen3_next "
                                             r"has recurrent layers \[0, 1, 2\], and pinned prefixes do not "
                                             r"keep their recurrent-state snapshots"),
])
def test_what_a_state_slot_cannot_serve_is_refused_by_name(hybrid, options, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine.from_dir(hybrid[0], EngineConfig(block_size=4, **options))


@pytest.mark.parametrize("model", ["hybrid", "nemotron"])
def test_speculative_drafts_rejected_leave_no_trace_in_the_state(model, request):
    """Prompt-lookup drafts verified by the hybrid target: the slot keeps the state after the accepted
    tokens only, so the tokens equal transformers' though drafts were rejected."""
    path, _, want = request.getfixturevalue(model)
    llm = LLM(path, block_size=4, max_num_batched_tokens=16,
              speculative=SpeculativeConfig(method="prompt_lookup", num_tokens=3))
    outs = llm.generate(PROMPTS, GREEDY)
    metrics = llm.engine.metrics
    assert [o.token_ids for o in outs] == want
    assert metrics.spec_proposed > metrics.spec_accepted  # drafts were rejected and rolled back


def test_a_verified_step_keeps_the_state_after_its_accepted_tokens():
    """The state a slot keeps after verifying drafts is the one after exactly the kept tokens, for
    every count kept (one decoded token, then each accepted draft)."""
    cfg = get_preset("tiny-qwen3-next", vocab_size=64)
    layer = Transformer(cfg, init_seed=1).layers["0"].attention
    x_1SD = torch.randn(1, 4, cfg.dim, generator=torch.Generator().manual_seed(0))
    pool = RecurrentStatePool(cfg, 2, torch.float32)
    start = layer.mix(torch.randn(1, 3, cfg.dim))[1]
    for kept in range(1, 5):
        pool.write(0, torch.tensor([1]), start)
        step = RecurrentStep(pool, [Segment(0, 4, 1, 3, drafts=3)], torch.device("cpu"))
        with torch.no_grad():
            step.mix_recurrent(0, layer.mix, x_1SD)
            torch.testing.assert_close(pool.read(0, torch.tensor([1])).delta, start.delta)  # nothing kept yet
            step.commit(1, kept)
            want = layer.mix(x_1SD[:, :kept], start)[1]
        got = pool.read(0, torch.tensor([1]))
        torch.testing.assert_close(got.delta, want.delta)
        torch.testing.assert_close(got.conv, want.conv)


def test_state_slots_are_paid_out_of_the_kv_budget():
    cfg = get_preset("tiny-qwen3-next")  # layers 0-2 Gated DeltaNet, layer 3 attention
    config = EngineConfig(kv_cache_gib=0.0005, max_num_seqs=8, block_size=4, enable_prefix_caching=False)
    per_block, per_slot = bytes_per_block(cfg, 4, torch.float32, False), bytes_per_slot(cfg, torch.float32)
    assert per_slot == 3 * (4 * (2 * 2 * 16 + 4 * 16) * 3 + 4 * 16 * 16 * 4)  # 3 layers: conv window, delta state
    assert per_block == 2 * 2 * 16 * 4 * 4  # keys and values of the one attention layer only
    budget = int(0.0005 * 2**30) - 8 * per_slot
    got = cache_geometry(cfg, config).num_blocks
    assert got == budget // per_block < int(0.0005 * 2**30) // per_block
    assert got // 4 == budget // (4 * per_block)  # n_layers / n_attention = 4 times the blocks of every layer storing


def test_a_kimi_delta_state_slot_holds_its_three_convolution_windows_and_a_state_per_head():
    cfg = get_preset("tiny-kimi-linear")  # layers 0-2 delta attention (2 heads of 16), layer 3 latent attention
    assert bytes_per_slot(cfg, torch.float32) == 3 * (4 * 3 * 2 * 16 * 3 + 2 * 16 * 16 * 4)
    pool = RecurrentStatePool(cfg, 2, torch.float32)
    assert pool.tensors[0]["conv"].shape == (2, 3 * 2 * 16, 3) and pool.tensors[2]["delta"].shape == (2, 2, 16, 16)
    assert kv_layers(cfg) == [3]


def test_the_kv_cache_holds_keys_and_values_of_the_attention_layers_only(hybrid):
    llm = LLM(hybrid[0], block_size=4, num_blocks=16, max_model_len=64)
    kv = llm.engine.kv
    assert kv_layers(llm.engine.cfg) == [3]
    assert [t.shape[0] for t in kv.k] == [t.shape[0] for t in kv.v] == [0, 0, 0, 17 * 4]  # 16 blocks + scratch
    assert kv.stores() == [kv.k[3], kv.v[3]]
    assert kv.nbytes == 17 * bytes_per_block(llm.engine.cfg, 4, torch.float32, False)
    kv.clear_blocks([2, 5])  # the empty stores are left alone
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hybrid[2]


def test_nemotron_h_keeps_keys_and_values_of_its_attention_layer_and_mamba_states_in_slots(nemotron):
    """Of Nemotron-H's five layers only the attention one stores keys and values (not the MLP ones);
    each Mamba-2 layer's slot holds its convolution window and SSD state, paid out of the budget, and
    the prefix cache's snapshots of them follow the slots."""
    llm = LLM(nemotron[0], block_size=4, num_blocks=16, max_model_len=64)
    cfg, kv = llm.engine.cfg, llm.engine.kv
    assert kv_layers(cfg) == [2] and [t.shape[0] for t in kv.k] == [0, 0, 17 * 4, 0, 0]
    pool = llm.engine.runner.paged.states
    m = cfg.mamba
    channels = m.n_heads * m.head_dim + 2 * m.n_groups * m.state_size
    assert pool.layers == [0, 3]
    n = llm.engine.config.max_num_seqs + pool.num_snapshots
    assert pool.num_snapshots > 0 and pool.num_slots == llm.engine.config.max_num_seqs
    assert {k: t.shape for k, t in pool.tensors[0].items()} == {
        "conv": (n, channels, m.conv_width - 1), "ssm": (n, m.n_heads, m.head_dim, m.state_size)}
    assert bytes_per_slot(cfg, torch.float32) == 2 * 4 * (channels * (m.conv_width - 1)
                                                         + m.n_heads * m.head_dim * m.state_size)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == nemotron[2]


def test_scoring_past_a_first_chunk_is_refused_by_name(hybrid):
    path, hf, _ = hybrid
    llm = LLM(path, block_size=4)
    ids = PROMPTS[0]
    logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    want = -float(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum())
    nll, n = paged_nll(llm.engine, ids, chunk=len(ids))  # one chunk: from a zero state
    assert n == len(ids) - 1 and abs(nll - want) < 1e-3
    with pytest.raises(ModelError, match=r"tokens at positions 8\.\. need the recurrent state of the positions "
                                         r"before them, which only a running request's slot keeps"):
        paged_nll(llm.engine, ids, chunk=8)


def test_a_hybrid_draft_model_is_refused_by_name(hybrid):
    spec = SpeculativeConfig(method="draft", draft_model=str(hybrid[0]))
    with pytest.raises(ConfigError, match=r"speculative.draft_model is a hybrid model \(model.family=qwen3_next\); "
                                          r"a draft model's cache holds attention keys and values only"):
        LLMEngine.from_dir(hybrid[0], EngineConfig(block_size=4, speculative=spec))

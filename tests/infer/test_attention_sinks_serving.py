"""Attention sinks (gpt-oss) on every paged path: with the C++ kernel (which steps aside for sink
layers) and without it (TESSERA_CPU_ATTENTION=torch: a prompt chunk after earlier context, the short
queries' group, the bucketed decode), prompts of different lengths under a small token budget and
with prefix reuse decode the tokens transformers does; a served step really hands the cache sinks."""

import pytest

from tessera.infer import LLM, SamplingParams
from tessera.infer.runner.paged_attention import PagedAttentionBatch
from tests.infer.tiny_models import hf_greedy, write_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["attention sinks soak up what a head does not want", "hi", "x = 1\ny = 2\n", "the same start, twice"]


@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_sink_layers_decode_as_transformers_on_every_path(kernel, tmp_path, monkeypatch):
    if kernel == "torch":
        monkeypatch.setenv("TESSERA_CPU_ATTENTION", "torch")
    handed = []
    attend = PagedAttentionBatch.attend

    def counting(self, *args, sinks=None, **kwargs):
        handed.append(sinks is not None)
        return attend(self, *args, sinks=sinks, **kwargs)

    monkeypatch.setattr(PagedAttentionBatch, "attend", counting)
    hf = write_model(tmp_path, "gpt_oss", std=0.25)
    # every block kept: prefix reuse and the static-shape decode step (the windowed pool's own test:
    # test_windowed_kv.py)
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=True, windowed_kv="kept")
    want = [hf_greedy(hf, llm.tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS]
    outs = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS[:1], GREEDY)  # its prefix from the cache
    assert [o.token_ids for o in outs] == want and again[0].token_ids == want[0]
    assert handed and all(handed)

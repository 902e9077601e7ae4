"""The packed step's forward never waits for the device: a step mixing decodes with several short
prompts (packed into one padded attention group) and a long one runs no op whose output size
depends on tensor values, in any layer, and its greedy output still equals HuggingFace's."""

import pytest

from tessera.infer import EngineConfig, LLMEngine, SamplingParams
from tests.infer.host_transfers import DataDependentOps
from tests.infer.tiny_models import hf_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
DECODING = ["hello world", "abc"]
JOINING = ["xyz", "a short one", "q", "a prompt longer than sixteen characters"]


class _Traced:
    """Runs the model under `mode` (only the forward: the batch's indices are built before it)."""

    def __init__(self, model, mode: DataDependentOps):
        self.model, self.mode = model, mode

    def __call__(self, *args, **kwargs):
        with self.mode:
            return self.model(*args, **kwargs)


@pytest.mark.parametrize("decode_batch_sizes", [None, []], ids=["bucketed-decodes", "packed-decodes"])
def test_a_mixed_step_forward_has_no_data_dependent_op(llama, monkeypatch, decode_batch_sizes):
    path, hf = llama
    engine = LLMEngine.from_dir(path, EngineConfig(block_size=4, decode_batch_sizes=decode_batch_sizes))
    tok = engine.tokenizer
    ids = [engine.add_request(tok.encode(p), GREEDY) for p in DECODING]
    done = {o.request_id: o for o in engine.step() if o.finished}  # prefilled: both decode from now on
    ids += [engine.add_request(tok.encode(p), GREEDY) for p in JOINING]
    mode, shapes = DataDependentOps(), []
    real = engine.runner.paged.forward_split

    def forward_split(items):
        shapes.append(sorted(len(it.tokens) for it in items))
        return real(items)

    monkeypatch.setattr(engine.runner.paged, "forward_split", forward_split)
    monkeypatch.setattr(engine.executor.local, "model", _Traced(engine.executor.local.model, mode))
    if engine.decoder is not None:
        monkeypatch.setattr(engine.decoder, "model", _Traced(engine.decoder.model, mode))
    done.update({o.request_id: o for o in engine.step() if o.finished})
    lengths = shapes[0]
    assert lengths.count(1) == 2 and sum(1 < n <= 16 for n in lengths) == 3 and lengths[-1] > 16, lengths
    # the mode saw the attention run: PyTorch's SDPA, or on CPU the kernel reading the cache in place
    assert any("scaled_dot_product" in name or name == "paged_attention" for name in mode.seen)
    assert mode.found == []
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt in zip(ids, DECODING + JOINING):
        assert done[rid].token_ids == hf_greedy(hf, tok.encode(prompt), 10), prompt

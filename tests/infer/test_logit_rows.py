"""The packed step computes the output head only for the rows its caller reads (each item's from
`logits_from` on: the last row of a completing prompt chunk, none of a chunk that does not complete,
every row when prompt log-probabilities are asked), and those rows equal the full forward's."""

from __future__ import annotations

import pytest
import torch

from tessera.infer import EngineConfig, LLMEngine, SamplingParams
from tessera.infer.runner.paged_model import BatchItem
from tests.infer.tiny_models import hf_greedy, write_model


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_only_read_rows_reach_the_head_and_equal_the_full_forward(tmp_path, family):
    write_model(tmp_path, family, tie_word_embeddings=False)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, decode_batch_sizes=[]))
    paged = engine.executor.local
    model = paged.model
    seen = []
    model.output.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))

    def items(froms):
        # three prompts in disjoint blocks: 7 tokens, 5 tokens, 9 tokens
        return [BatchItem([3, 8, 1, 9, 4, 4, 2], 0, [0, 1], logits_from=froms[0]),
                BatchItem([5, 6, 7, 1, 2], 0, [2, 3], logits_from=froms[1]),
                BatchItem([9, 9, 3, 1, 5, 6, 2, 8, 7], 0, [4, 5, 6], logits_from=froms[2])]

    full_TV = paged.forward(items([0, 0, 0]))
    assert seen == [21]
    # the first completes (its last row), the second is a chunk read by nobody, the third is scored
    part_TV = paged.forward(items([6, 5, 0]))
    assert seen == [21, 1 + 0 + 9]
    read = [6] + list(range(12, 21))
    torch.testing.assert_close(part_TV[read], full_TV[read], rtol=1e-5, atol=1e-5)
    assert part_TV.shape == full_TV.shape
    # nothing read: the head does not run on any row
    paged.forward(items([7, 5, 9]))
    assert seen[-1] == 0


def test_chunked_prompts_give_greedy_and_prompt_logprobs_equal_to_transformers(tmp_path):
    hf = write_model(tmp_path, "llama", tie_word_embeddings=False)
    engine = LLMEngine.from_dir(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8))
    prompt = [3, 8, 1, 9, 4, 4, 2, 7, 7, 1, 5, 6, 2, 8, 3, 9, 1, 2, 3]  # three chunks of 8 tokens at most
    asks = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0),
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    rids = [engine.add_request(prompt, p) for p in asks]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    want = hf_greedy(hf, prompt, 6)
    assert [done[r].token_ids for r in rids] == [want, want]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    got = [e.logprob for e in done[rids[0]].prompt_logprobs]
    assert got == pytest.approx([logp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)], abs=1e-4)

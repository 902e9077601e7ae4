"""Loading a Tessera training checkpoint for serving: the model comes back from the weights alone,
whatever else (optimizer state, trainer state) the trainer wrote beside them."""

import pickle

import torch

from tessera.checkpoint.dcp import save_checkpoint
from tessera.hf import load_pretrained
from tessera.infer import LLM, SamplingParams
from tests.infer.tiny_models import hf_greedy, write_model


def test_serves_a_tessera_training_checkpoint(tmp_path):
    path = tmp_path / "hf"
    hf = write_model(path, "llama", std=0.25)
    model = load_pretrained(path)
    meta = {"config": {"model": model.cfg.to_dict(), "data": {"tokenizer": str(path)}}, "layout": {}}
    state = {"model": model.state_dict(), "optim": {"state.tok_embeddings.weight.exp_avg": torch.zeros(3)},
             "trainer": pickle.dumps({"step": 7})}  # what the trainer writes besides the weights
    save_checkpoint(tmp_path / "run" / "checkpoints", 7, state, meta, keep_last=1)
    llm = LLM(tmp_path / "run", block_size=4)
    out = llm.generate(["from a checkpoint"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, llm.tokenizer.encode("from a checkpoint"), 10)
    assert torch.equal(llm.engine.model.tok_embeddings.weight, model.tok_embeddings.weight)

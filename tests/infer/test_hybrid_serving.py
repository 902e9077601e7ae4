"""A hybrid model (Qwen3-Next's Gated DeltaNet layers) cannot be served by the paged engine yet:
`LLM`, `tessera serve` and the cached `tessera generate` refuse it by name (hybrid layers need the
recurrent-state cache), while `tessera generate --no-cache` runs it on the model's own forward."""

import pytest
import torch

from tessera.cli import main
from tessera.config import ModelError, get_preset
from tessera.hf import save_pretrained
from tessera.infer import LLM, SamplingParams
from tessera.infer.engine.reference_generation import reference_generate
from tessera.models import Transformer
from tests.infer.tiny_models import char_tokenizer, save_tokenizer

REFUSAL = r"model.family=qwen3_next has linear-attention layers .*hybrid layers need the recurrent-state cache"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    model = Transformer(get_preset("tiny-qwen3-next", vocab_size=128, init_std=0.2), init_seed=2)
    path = tmp_path_factory.mktemp("hybrid") / "hf"
    save_pretrained(model, path)
    save_tokenizer(path)
    return model, path


def test_engine_refuses_a_hybrid_model(hybrid):
    with pytest.raises(ModelError, match=REFUSAL):
        LLM(hybrid[0])


def test_serve_and_cached_generate_refuse_it_and_no_cache_generates(hybrid, capsys):
    model, path = hybrid
    assert main(["serve", str(path), "--port", "0", "--device", "cpu"]) == 1
    assert main(["generate", str(path), "--prompt", "ab", "--max-new-tokens", "4"]) == 1
    assert "hybrid layers need the recurrent-state cache" in capsys.readouterr().err
    assert main(["generate", str(path), "--prompt", "ab", "--max-new-tokens", "4", "--no-cache"]) == 0
    prompt = char_tokenizer().encode("ab", add_special_tokens=False).ids
    with torch.no_grad():
        want = reference_generate(model, prompt, SamplingParams(max_tokens=4, temperature=0.0))
    assert capsys.readouterr().out.strip() == "ab" + char_tokenizer().decode(want, skip_special_tokens=True)

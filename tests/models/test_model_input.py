"""`Transformer.forward`'s one typed input (tessera/models/model_input.py): token ids alone are the
shorthand, hidden states are said by their field, and a ModelInput that holds the sequence twice,
not at all, or as floats where it says token ids is refused by name."""

import pytest
import torch

from tessera.config import get_preset
from tessera.config.errors import ModelError
from tessera.models import ModelInput, Transformer


def _model_and_ids() -> tuple[Transformer, torch.Tensor]:
    model = Transformer(get_preset("tiny-llama"), init_seed=0)
    return model, torch.randint(0, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))


def test_token_ids_alone_are_the_shorthand_of_a_model_input():
    model, ids = _model_and_ids()
    assert torch.equal(model(ids).logits, model(ModelInput(tokens=ids)).logits)


def test_hidden_states_enter_the_first_layer_as_the_embedding_would():
    model, ids = _model_and_ids()
    out = model(ModelInput(hidden=model.tok_embeddings(ids), keep_layers=(0,)))
    assert torch.equal(out.logits, model(ids).logits)
    assert torch.equal(out.kept_hidden, model.tok_embeddings(ids))


def test_the_sequence_is_given_once_as_token_ids_or_hidden_states():
    model, ids = _model_and_ids()
    h = model.tok_embeddings(ids)
    with pytest.raises(ModelError, match="not both"):
        ModelInput(tokens=ids, hidden=h)
    with pytest.raises(ModelError, match="not neither"):
        ModelInput(targets=ids)
    with pytest.raises(ModelError, match=r"token ids, not torch.float32 values: .* ModelInput\(hidden=...\)"):
        model(h)


def test_a_model_input_is_a_pytree_whose_tensors_are_reached():
    from torch.utils._pytree import tree_flatten, tree_unflatten

    _, ids = _model_and_ids()
    leaves, spec = tree_flatten(ModelInput(tokens=ids, targets=ids, keep_layers=(0, 2)))
    assert sum(leaf is ids for leaf in leaves) == 2
    back = tree_unflatten(leaves, spec)
    assert back.tokens is ids and back.keep_layers == (0, 2)

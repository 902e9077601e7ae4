"""Shared tiny model directories (written once per test session)."""

from __future__ import annotations

import pytest

from tests.infer.tiny_models import write_model


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    """(directory, HuggingFace model) of a tiny random Llama with varied greedy output."""
    path = tmp_path_factory.mktemp("llama")
    return path, write_model(path, "llama", std=0.25)


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return path, write_model(path, "mixtral", std=0.25)


@pytest.fixture(scope="session")
def family_models(llama, mixtral):
    return {"llama": llama, "mixtral": mixtral}


@pytest.fixture(scope="session")
def llava(tmp_path_factory):
    """(directory, transformers model) of a tiny LLaVA (CLIP tower, Llama LM) with the char tokenizer."""
    from tests.infer.tiny_llava import write_llava

    path = tmp_path_factory.mktemp("llava")
    return path, write_llava(path)


@pytest.fixture(scope="session")
def scripted_agent(tmp_path_factory):
    """The directory of the scripted agent of the tool tests (agent_scripts.py), trained once a session
    for every API's tests (Qwen2.5's template; `with_template` for Qwen3's)."""
    from tests.infer.agent_models import QWEN25_TEMPLATE, write_scripted_agent
    from tests.infer.agent_scripts import script

    path = tmp_path_factory.mktemp("scripted-agent")
    write_scripted_agent(path, QWEN25_TEMPLATE, script())
    return path

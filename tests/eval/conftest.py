import pytest

from tests.eval.local_tasks import write_local_tasks
from tests.infer.tiny_models import write_model


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """A random LLaMA of the character tokenizer (vocabulary 128), 256 positions, as a HuggingFace directory."""
    path = tmp_path_factory.mktemp("tiny_hf")
    write_model(path, "llama", seed=3, std=0.3)
    return path


@pytest.fixture(scope="session")
def local_tasks(tmp_path_factory):
    return write_local_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """The `datasets` library caches what it reads from the local JSONL under the test's directory,
    not in the user's cache."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> str:
    from tests.train.runs import build_small_dataset

    return build_small_dataset(tmp_path_factory.mktemp("data"))

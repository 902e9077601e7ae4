import pytest

from tests.train.runs import build_small_dataset


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> str:
    return build_small_dataset(tmp_path_factory.mktemp("data"))

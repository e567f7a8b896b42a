"""The data tests' shared fixtures: one corpus and its preparation per test module."""

from pathlib import Path

import pytest

from scalevec_train.data import PreparedData, prepare_data
from tests.support.corpora import text_cfg, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> PreparedData:
    # Small shards, so that loader windows cross shard boundaries.
    return prepare_data(text_cfg(corpus[0], tmp_path_factory.mktemp("cache"), shard_tokens=1000))

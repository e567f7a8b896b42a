"""Shared fixtures: a small real-text corpus (a slice of the standard library) and its cache."""

import shutil
import sysconfig
from pathlib import Path

import pytest

# Modules whose source makes a ~300 KB corpus: enough to train a tokenizer and see the loss fall.
CORPUS_MODULES = ["argparse.py", "dataclasses.py", "functools.py", "inspect.py", "pathlib.py", "typing.py",
                  "enum.py", "json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shutil.py"]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        shutil.copy(stdlib / name, root / name.replace("/", "_"))
    return root


@pytest.fixture(scope="session")
def data_overrides(corpus_dir, tmp_path_factory) -> list[str]:
    """Hydra overrides for a fast run on the small corpus (tokenizer and shards cached per session)."""
    cache = tmp_path_factory.mktemp("data_cache")
    return ["data=text_dir", f"data.path={corpus_dir}", f"data.cache_dir={cache}", "model.vocab_size=512",
            "logger.progress_bar=false"]

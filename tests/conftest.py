"""Shared fixtures: a small real-text corpus (a slice of the standard library) and its cache.

The suite is a CPU suite on any machine: unless SCALEVEC_GPU_TESTS=1, the GPUs are hidden from this
process and every process it starts (before anything initializes CUDA), so that `device=auto` means
the CPU, tolerances stay the CPU's, and a 2-rank launch never asks a 1-GPU host for device 1. The
GPU tests (tests/gpu) run with SCALEVEC_GPU_TESTS=1 (make test-gpu, dev/gpu_session.sh), and only
there. Processes a test starts belong to the `processes` / `module_processes` fixtures
(tests/support/launch.py).
"""

import os
import shutil
import sysconfig
from pathlib import Path

import pytest

GPU_TESTS = os.environ.get("SCALEVEC_GPU_TESTS") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # One intra-op thread (read when torch is imported): the suite's tiny models gain nothing from
    # more, and on cores shared with other processes OpenMP threads spin waiting for a descheduled
    # sibling, which made single-process training tests up to 10x slower beside a busy process.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Inductor compiles in the process that compiles: its default pool of compile workers (one per
    # core) starts Python and imports torch in each process that compiles, for the few kernels of a
    # tiny model.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/gpu belongs to the GPU run, and the GPU run is tests/gpu alone."""
    parts = collection_path.relative_to(Path(__file__).parent).parts
    if not parts:
        return None
    return (parts[0] == "gpu") != GPU_TESTS


# Modules whose source makes a ~300 KB corpus: enough to train a tokenizer and see the loss fall.
CORPUS_MODULES = ["argparse.py", "dataclasses.py", "functools.py", "inspect.py", "pathlib.py",
                  "typing.py", "enum.py", "json/decoder.py", "json/encoder.py", "textwrap.py",
                  "string.py", "shutil.py"]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        shutil.copy(stdlib / name, root / name.replace("/", "_"))
    return root


@pytest.fixture(scope="session")
def data_overrides(corpus_dir, tmp_path_factory) -> list[str]:
    """Hydra overrides for a fast run on the small corpus (tokenizer and shards cached per
    session)."""
    cache = tmp_path_factory.mktemp("data_cache")
    return ["data=text_dir", f"data.path={corpus_dir}", f"data.cache_dir={cache}",
            "model.vocab_size=512", "logger.progress_bar=false"]


@pytest.fixture
def processes(tmp_path):
    """Starts the processes of one test; kills whatever of them still runs when the test ends."""
    from tests.support.launch import Processes  # here: importing torch is left to the tests

    owned = Processes(tmp_path)
    yield owned
    owned.kill()


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory):
    """The same for a module's fixtures."""
    from tests.support.launch import Processes

    owned = Processes(tmp_path_factory.mktemp("processes"))
    yield owned
    owned.kill()


@pytest.fixture(scope="module")
def attempts(module_processes, tmp_path_factory):
    """Attempts of 2-rank runs forked from one torchrun launch that a module's tests share."""
    from tests.support.launch import Attempts

    started = Attempts(module_processes, tmp_path_factory.mktemp("attempts") / "spec")
    yield started
    started.close()

"""Shared fixtures: a small real-text corpus (a slice of the standard library) and its cache.

The suite is a CPU suite on any machine: unless SCALEVEC_GPU_TESTS=1, the GPUs are hidden from this
process and every process it starts (before anything initializes CUDA), so that `device=auto` means the
CPU, tolerances stay the CPU's, and a 2-rank launch never asks a 1-GPU host for device 1. The GPU tests
(tests/gpu) run with SCALEVEC_GPU_TESTS=1 (make test-gpu, dev/gpu_session.sh), and only there.
Processes a test starts belong to the `processes` / `module_processes` fixtures (tests/support/launch.py).
"""

import os
import shutil
import sysconfig
from pathlib import Path

import pytest

GPU_TESTS = os.environ.get("SCALEVEC_GPU_TESTS") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # One intra-op thread (read when torch is imported): the suite's tiny models gain nothing from more,
    # and on cores shared with other processes OpenMP threads spin waiting for a descheduled sibling,
    # which made single-process training tests up to 10x slower beside a busy process.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/gpu belongs to the GPU run, and the GPU run is tests/gpu alone."""
    parts = collection_path.relative_to(Path(__file__).parent).parts
    if not parts:
        return None
    return (parts[0] == "gpu") != GPU_TESTS


# The files that take longest (seconds of one worker: 120 down to 30, 2-core machine, 2026-12-02), run
# first. pytest-xdist's loadfile hands files out in collection order, so one of these started last would
# leave the other core idle while it finishes. The rest keep their order.
SLOWEST_FIRST = ["parallel/test_watchdog.py", "training/test_reliability.py", "parallel/test_compile.py",
                 "parallel/test_expert_parallel.py", "training/test_faults.py", "parallel/test_world_sizes.py",
                 "training/test_probes.py", "test_recipes.py", "kernels/test_rms_norm.py", "test_experiments.py",
                 "kernels/test_compile_ahead.py", "dev/test_bit_matrix.py", "dev/test_gpu_session.py"]


def pytest_collection_modifyitems(config, items) -> None:
    tests = Path(__file__).parent
    missing = [name for name in SLOWEST_FIRST if not (tests / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST names {missing}, which do not exist. Fix: "
                                "rename or drop them there.")
    order = {tests / name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path, len(order)))


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

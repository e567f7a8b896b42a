"""scripts/bench_train.py on the CPU: a measured run leaves nothing of itself allocated once bench()
returns, so that the next pair's peak memory is its own (the first H200 visit's eager unified
dense-1b row counted the baseline run's parameters and AdamW state, kept by a reference cycle
through the timing wrapper)."""

import math
import weakref

import pytest

from tests.support.helpers import REPO, load_script


@pytest.fixture(scope="module")
def bench_train():
    return load_script(REPO / "scripts" / "bench_train.py")


def test_a_run_leaves_nothing_alive(bench_train, data_overrides, monkeypatch):
    built = []

    def build(cfg):
        run = bench_train_build(cfg)
        built.append(run.trainer)
        return run

    bench_train_build = bench_train.build
    monkeypatch.setattr(bench_train, "build", build)
    args = bench_train.parse_args(["--presets", "dense-tiny", "--scales", "baseline",
                                   "--no-compile", "--seq-len", "32", "--micro-batch", "2",
                                   "--steps", "1", "--warmup", "1", "--", *data_overrides])
    row = bench_train.bench("dense-tiny", "baseline", args)
    assert float(row["optimizer ms"]) >= 0 and float(row["data ms"]) >= 0, row
    # the loss of the first step (a fresh model: about ln of the vocabulary of 512) and of the last
    first, last = map(float, row["loss"].split(" -> "))
    assert abs(first - math.log(512)) < 0.3 and math.isfinite(last), row
    trainer = built.pop()
    optimizer, loader = trainer.optimizer, trainer.loader
    # the timing wrappers are gone: the optimizer's and the loader's own methods show through
    assert "step" not in vars(optimizer) and "next_batch" not in vars(loader)
    kept = [weakref.ref(x)
            for x in (trainer, trainer.model, optimizer, next(trainer.model.parameters()))]
    del trainer, optimizer, loader
    # no gc.collect(): what a reference cycle keeps stays alive here
    assert [ref() is None for ref in kept] == [True] * len(kept)

"""The single-process trainer end to end: files written, exact resume, every strategy trains; the
order its callbacks run in."""

import shutil
from pathlib import Path

import pytest

from scalevec_train.train import run
from scalevec_train.training.callbacks import (
    Diagnostics,
    ModelMetrics,
    SigtermStop,
    StabilityGuard,
    StepProfiler,
)
from scalevec_train.training.trainer import Callback, ordered
from tests.support.helpers import make_config
from tests.support.launch import curve, records
from tests.support.presets import SMALL_MODEL

FAST = [*SMALL_MODEL, "model.ffn_dim=176",
        "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.eval_batches=2",
        "schedule.warmup_steps=2"]


def test_run_writes_metrics_config_and_checkpoint(tmp_path, data_overrides):
    out = run(make_config(*data_overrides, *FAST, "train.steps=6", "train.log_every=2",
                          "train.eval_every=3", f"run_dir={tmp_path / 'r'}"))
    logged_records = records(out)
    logged = [r for r in logged_records if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for r in logged:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= r.keys()
        assert r["tokens"] == r["step"] * 8 * 64
    assert [r["step"] for r in logged_records if "val_loss" in r] == [0, 3, 6]
    assert [r["step"] for r in logged_records if "val_bpb" in r] == [0, 3, 6]
    # site values and gradient norms, aggregated and per layer, on every logged step
    for r in logged:
        assert {"scale/attn_norm.sites.attn/mean", "scale/L1/ffn_norm.sites.ffn/max",
                "scale/attn_norm.sites.attn/grad_norm", "scale/L1/attn_norm.sites.attn/grad_norm",
                "scale/final_norm.sites.final/grad_norm"} <= r.keys()
        assert r["scale/attn_norm.sites.attn/grad_norm"] > 0
    assert (out / "config.yaml").read_text().count("dense-tiny") >= 1
    assert (out / "checkpoints" / "step_000006" / "COMPLETE").is_file()


def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, data_overrides):
    common = [*data_overrides, *FAST, "train.steps=8", "train.log_every=1", "checkpoint.every=4",
              "checkpoint.keep_last=5"]
    full = run(make_config(*common, f"run_dir={tmp_path / 'full'}"))
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_000004",
                    resumed_dir / "checkpoints" / "step_000004")
    run(make_config(*common, f"run_dir={resumed_dir}", "resume=auto"))
    expected, got = curve(full), curve(resumed_dir)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=0), step


@pytest.mark.parametrize("scale",
                         ["none", "baseline", "iwd", "hg", "dp", "dnp", "or", "er", "unified"])
def test_every_strategy_trains(tmp_path, data_overrides, scale):
    out = run(make_config(*data_overrides, *FAST, f"scale={scale}", "train.steps=30",
                          "train.log_every=5", "optim.lr=1e-2", f"run_dir={tmp_path / scale}"))
    loss_curve = curve(out)
    assert loss_curve[30] < loss_curve[5] - 0.3
    # Every learnable scale site moves: its logged statistics (of s and of an or/er magnitude, per
    # layer and over layers) change between the first and the last logged step.
    logged = [r for r in records(out) if "loss" in r]
    sites = {k.rsplit("/", 1)[0] for k in logged[-1] if k.startswith("scale/")
             and not k.endswith("/grad_norm")}
    assert bool(sites) == (scale != "none")
    for site in sites:
        stats = [f"{site}/{stat}" for stat in ("mean", "std", "min", "max")]
        assert any(logged[0][key] != logged[-1][key] for key in stats), site


def test_callbacks_run_in_the_order_of_their_priorities():
    """Trainer hooks run on ordered(callbacks): lower priority first, equal priorities as given. The
    profiler (-1) first, Diagnostics (1) after ModelMetrics (0) wherever they were given, the rest
    as given."""
    profiler = StepProfiler([], Path("unused"), rank=0)
    diagnostics, metrics, guard = (Diagnostics(every=1, batch=None), ModelMetrics(),
                                   StabilityGuard(3, 5.0))
    assert (ordered([diagnostics, guard, metrics, profiler])
            == [profiler, guard, metrics, diagnostics])
    assert ordered([metrics, guard, diagnostics]) == [metrics, guard, diagnostics]

    class Last(Callback):
        priority = 2

    last, sigterm = Last(), SigtermStop()
    assert (ordered([last, diagnostics, sigterm, profiler, guard, metrics])
            == [profiler, sigterm, guard, metrics, diagnostics, last])

"""Compute efficiency on synthetic ladders with a known multiplier: the reference's terminal loss
follows L_R(C) = E + A C^(-alpha) and the strategy's is L_R(k C), so the strategy reaches every loss
with k times less compute; seeds scatter around those losses symmetrically."""

import csv
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from scalevec_analysis import compute_efficiency, efficiency_series, load_run_dir, reference_compute
from scalevec_analysis.efficiency import SUMMARY, find_reference
from scalevec_analysis.scaling import PowerLawFit
from scalevec_train.infra.errors import ScalevecError
from tests.support.helpers import REPO, load_script

E, A, ALPHA = 1.8, 1000.0, 0.2
# ladder points: (model, training FLOPs per token, terminal tokens)
LADDER = [("l1", 2e6, 1e7), ("l2", 8e6, 4e7), ("l3", 3e7, 1.5e8), ("l4", 1.2e8, 6e8),
          ("l6", 5e8, 2.5e9)]
SEED_OFFSETS = (-0.004, 0.0, 0.004)


def law(compute: float) -> float:
    return E + A * compute ** -ALPHA


def write_ladder(root: Path, multiplier: float, strategy: str = "unified",
                 bpb_multiplier: float | None = None) -> list[Path]:
    """With bpb_multiplier, the records also hold a val_bpb whose law has that multiplier (in other
    units: bits per byte are nats per token times a constant here)."""
    dirs = []
    for scale, k in (("baseline", 1.0), (strategy, multiplier)):
        for model, flops, tokens in LADDER:
            for seed, offset in enumerate(SEED_OFFSETS):
                d = root / f"{model}-{scale}-s{seed}"
                d.mkdir(parents=True)
                config = {"seed": seed, "run_dir": str(d), "model": {"name": model},
                          "scale": {"name": scale}, "train": {"tokens_per_param": 20}}
                (d / "config.yaml").write_text(yaml.safe_dump(config))
                (d / "describe.json").write_text(json.dumps({"total_params": 1,
                                                             "train_flops_per_token": flops}))
                records = [{"step": 0, "tokens": 0, "val_loss": 9.0},
                           {"step": 100, "tokens": tokens,
                            "val_loss": law(k * flops * tokens) + offset}]
                if bpb_multiplier is not None:
                    k_bpb = 1.0 if scale == "baseline" else bpb_multiplier
                    for r in records:
                        r["val_bpb"] = (0.4 * (law(k_bpb * flops * tokens) + offset) if r["step"]
                                        else 3.0)
                (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
                dirs.append(d)
    return dirs


@pytest.mark.parametrize("multiplier", [1.25, 1.0, 0.8])
def test_a_known_multiplier_is_recovered_within_its_interval(tmp_path, multiplier):
    runs = [load_run_dir(d) for d in write_ladder(tmp_path, multiplier)]
    series = efficiency_series(runs)
    reference = find_reference(series, "scale=baseline")
    assert [p.compute for p in reference.points] == [f * t for _, f, t in LADDER]
    rows, fits = compute_efficiency(series, reference, bootstrap=300)
    assert fits[reference.label].alpha == pytest.approx(ALPHA, rel=1e-6)
    assert [r.point for r in rows] == [f"model={m}" for m, _, _ in LADDER] + [SUMMARY]
    for row in rows:
        for m in (row.law_at_loss, row.law_at_fit):
            # the seeds average to the law, so the estimate is the true multiplier; the interval
            # holds it
            assert m.value == pytest.approx(multiplier, rel=1e-6), row.point
            assert m.low < multiplier < m.high, row.point
    summary = rows[-1].law_at_fit
    # seed noise of +-0.004 resolves a multiplier of 1.25 from 1: a wrong one falls outside
    assert summary.high - summary.low < 0.2
    assert not summary.low < (1.0 if multiplier != 1.0 else 1.25) < summary.high


def test_reference_compute_inverts_the_law():
    fit = PowerLawFit(E=E, A=A, alpha=ALPHA, rmse=0.0)
    assert reference_compute(fit, law(3.5e12)) == pytest.approx(3.5e12, rel=1e-9)
    assert reference_compute(fit, E) == math.inf == reference_compute(fit, E - 0.1)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the analysis extra)")
def test_compare_runs_efficiency_writes_plot_and_tables(tmp_path):
    cli = load_script(REPO / "scripts" / "compare_runs.py")
    dirs = write_ladder(tmp_path / "runs", 1.25)
    out = tmp_path / "out"
    assert cli.main([*map(str, dirs), "--efficiency", "--reference", "scale=baseline", "--out",
                     str(out), "--bootstrap", "100", "--extrapolate", "dense-0.12b", "--budgets",
                     "2.5"]) == 0
    assert (out / "efficiency.png").stat().st_size > 10_000
    # trend.md: a section per strategy, and the extrapolation's row at dense-0.12b's compute with
    # these runs' sequence and vocabulary (their terminal points are beyond the reference's curves:
    # no trend)
    trend = (out / "trend.md").read_text()
    compute = cli.ladder_compute("dense-0.12b", 2.5, [load_run_dir(d) for d in dirs[:1]])
    assert trend.startswith("## scale=unified against scale=baseline")
    assert f"| dense-0.12b | {compute:.4g} | 2.5 | no pooled trend at this budget |" in trend
    rows = list(csv.DictReader((out / "efficiency.csv").open()))
    assert [r["point"] for r in rows][-1] == SUMMARY
    assert float(rows[-1]["law_at_fit"]) == pytest.approx(1.25, rel=1e-6)
    assert ("| scale=unified | all points (geometric mean) | 15 |"
            in (out / "efficiency.md").read_text())


def test_efficiency_needs_three_ladder_points_and_flops(tmp_path):
    dirs = write_ladder(tmp_path, 1.25)
    few = [load_run_dir(d) for d in dirs if d.name.startswith(("l1", "l2"))]
    series = efficiency_series(few)
    with pytest.raises(ScalevecError, match="has 2 points of distinct compute"):
        compute_efficiency(series, find_reference(series, "scale=baseline"))
    run = load_run_dir(dirs[0])
    run.flops_per_token = None
    with pytest.raises(ScalevecError, match="no training FLOPs per token"):
        efficiency_series([run])
    assert np.isfinite(load_run_dir(dirs[0]).flops_per_token)


def test_val_bpb_is_a_metric_of_the_fit(tmp_path):
    """val_loss and val_bpb of the same runs carry different multipliers: each metric recovers
    its own."""
    runs = [load_run_dir(d) for d in write_ladder(tmp_path, 1.0, bpb_multiplier=1.25)]
    for metric, multiplier in (("val_loss", 1.0), ("val_bpb", 1.25)):
        series = efficiency_series(runs, metric)
        rows, _ = compute_efficiency(series, find_reference(series, "scale=baseline"), bootstrap=50)
        assert rows[-1].law_at_fit.value == pytest.approx(multiplier, rel=1e-6), metric


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the analysis extra)")
def test_compare_runs_takes_val_bpb_as_the_metric(tmp_path):
    cli = load_script(REPO / "scripts" / "compare_runs.py")
    dirs = write_ladder(tmp_path / "runs", 1.0, bpb_multiplier=1.25)
    out = tmp_path / "out"
    assert cli.main([*map(str, dirs), "--efficiency", "--reference", "scale=baseline", "--out",
                     str(out), "--bootstrap", "50", "--metric", "val_bpb"]) == 0
    summary = list(csv.DictReader((out / "efficiency.csv").open()))[-1]
    assert float(summary["law_at_fit"]) == pytest.approx(1.25, rel=1e-6)
    assert cli.main([*map(str, dirs[:3]), "--reference", "scale=baseline", "--out",
                     str(out / "summary"), "--metric", "val_bpb"]) == 0
    assert "terminal val_bpb" in (out / "summary" / "summary.md").read_text()

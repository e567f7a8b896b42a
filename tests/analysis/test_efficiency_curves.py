"""The compute multiplier read from the reference's measured curves (scalevec_analysis.envelope), on
a hand-made ladder whose every number is worked out here, and the power law fitted with E >= 0."""

import csv
import importlib.util
import json
import math

import numpy as np
import pytest
import yaml

from scalevec_analysis import compute_efficiency, efficiency_series, fit_power_law, load_run_dir
from scalevec_analysis.efficiency import SUMMARY, find_reference
from scalevec_analysis.envelope import (
    ABOVE,
    AT_MOST,
    EXACT,
    Reading,
    geometric_mean,
    read_multiplier,
)
from scalevec_train.infra.errors import ScalevecError
from tests.support.helpers import REPO, load_script

FLOPS = {"l1": 10.0, "l2": 40.0}  # training FLOPs per token: compute = FLOPS x tokens


def write_run(root, name, scale, model, seed, tpp, rows, branch_from=None):
    d = root / name
    d.mkdir(parents=True)
    steps = {2.5: 10, 5: 20, 10: 40}[tpp]
    config = {"seed": seed, "run_dir": str(d), "model": {"name": model}, "scale": {"name": scale},
              "train": {"tokens_per_param": tpp, "steps": steps},
              "checkpoint": {"every": steps // 4}, "branch_from": branch_from or ""}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    (d / "describe.json").write_text(json.dumps({"total_params": 1,
                                                 "train_flops_per_token": FLOPS[model]}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def evals(points):
    """(tokens, val_loss) -> records, one every 10 steps of 10 tokens each, as the trainer
    logs them."""
    return [{"step": t // 10, "tokens": t, "val_loss": v} for t, v in points]


# The reference (baseline) on rung l1, per seed: a trunk to 400 tokens (10 tokens per parameter),
# decayed at its end, and a branch decayed to 200 tokens from the trunk's checkpoint at 100. The
# trunk's evaluations in its stable phase (4.6 at 200) lie above the branch's end (4.3 at 200).
TRUNK = {0: [(0, 9.0), (100, 5.0), (200, 4.6), (300, 4.5), (400, 4.1)],
         1: [(0, 9.0), (100, 5.2), (200, 4.8), (300, 4.6), (400, 4.2)]}
BRANCH_END = {0: 4.3, 1: 4.4}
# The strategy (unified) on rung l1: terminal loss per (tokens per parameter, seed)
UNIFIED = {(5, 0): 4.2, (5, 1): 4.45, (10, 0): 4.0, (10, 1): 4.25, (2.5, 0): 5.1, (2.5, 1): 5.3}


def write_ladder(root):
    dirs = []
    for seed in (0, 1):
        trunk = write_run(root, f"l1-baseline-tpp10-s{seed}", "baseline", "l1", seed, 10,
                          evals(TRUNK[seed]))
        # a branch's metrics.jsonl: its trunk's records up to the branch point, a record naming the
        # checkpoint (no number in it), then its own
        branch = [*evals(TRUNK[seed][:2]),
                  {"step": 10, "branch_from": f"{trunk}/checkpoints/step_10"},
                  *evals([(200, BRANCH_END[seed])])]
        dirs += [trunk, write_run(root, f"l1-baseline-tpp5-s{seed}", "baseline", "l1", seed, 5,
                                  branch, str(trunk))]
        # rung l2, one budget: with l1's two, the reference's law has its 3 points
        dirs.append(write_run(root, f"l2-baseline-tpp10-s{seed}", "baseline", "l2", seed, 10,
                              evals([(0, 9.0), (400, 3.5)])))
        dirs.append(write_run(root, f"l2-unified-tpp10-s{seed}", "unified", "l2", seed, 10,
                              evals([(0, 9.0), (400, 3.4)])))
        for tpp, tokens in ((2.5, 100), (5, 200), (10, 400)):
            dirs.append(write_run(root, f"l1-unified-tpp{tpp}-s{seed}", "unified", "l1", seed, tpp,
                                  evals([(0, 9.0), (tokens, UNIFIED[tpp, seed])])))
    return dirs


# By hand, seed 0's envelope of l1 (compute = 10 x tokens; the step-0 records have no compute):
# (1000, 5.0), (2000, 4.3: the branch's end, below the trunk's 4.6), (3000, 4.3: the trunk's 4.5 is
# no lower), (4000, 4.1). Seed 1's: (1000, 5.2), (2000, 4.4), (3000, 4.4), (4000, 4.2).
EXPECTED = {
    # 4.2: between (3000, 4.3) and (4000, 4.1), half way in log compute:
    # sqrt(3000 * 4000) / 2000 = sqrt(3); lower than the reference's 4.3 at its own compute, so
    # above 1
    ("train.steps=20", 0): Reading(math.sqrt(3)),
    # 4.45: between (1000, 5.2) and (2000, 4.4), (5.2 - 4.45) / (5.2 - 4.4) = 15/16 of the way:
    # 1000 * 2^(15/16) / 2000; higher than the reference's 4.4 at its own compute, so below 1
    ("train.steps=20", 1): Reading(2 ** (15 / 16) / 2),
    # 4.0: below anything the reference reached; its largest compute 4000 over the run's 4000
    ("train.steps=40", 0): Reading(1.0, ABOVE),
    # 4.25: between (3000, 4.4) and (4000, 4.2), 3/4 of the way: 3000 * (4/3)^(3/4) / 4000
    ("train.steps=40", 1): Reading(0.75 * (4 / 3) ** 0.75),
    # 5.1 and 5.3: the reference is already lower at its first evaluation, 1000, over the run's 1000
    ("train.steps=10", 0): Reading(1.0, AT_MOST),
    ("train.steps=10", 1): Reading(1.0, AT_MOST),
}


def assert_reading(got, want):
    assert got.bound == want.bound and got.value == pytest.approx(want.value, rel=1e-12)


def test_the_multiplier_from_the_references_curves_by_hand(tmp_path):
    runs = [load_run_dir(d) for d in write_ladder(tmp_path)]
    series = efficiency_series(runs)
    reference = find_reference(series, "scale=baseline")
    rows, fits = compute_efficiency(series, reference, bootstrap=20)
    by_point = {r.point: r for r in rows}
    for (point, seed), want in EXPECTED.items():
        assert_reading(by_point[f"model=l1 {point}"].per_seed[seed], want)
    # per point, the geometric mean over the seeds; a bound when one seed's is
    assert_reading(by_point["model=l1 train.steps=20"].curves,
                   Reading(math.sqrt(math.sqrt(3) * 2 ** (15 / 16) / 2)))
    assert_reading(by_point["model=l1 train.steps=40"].curves,
                   Reading(math.sqrt(0.75 * (4 / 3) ** 0.75), ABOVE))
    assert_reading(by_point["model=l1 train.steps=10"].curves, Reading(1.0, AT_MOST))
    # l2: the reference has one point (3.5 at 16000); unified's 3.4 there is never reached
    assert_reading(by_point["model=l2 train.steps=40"].curves, Reading(1.0, ABOVE))
    # the summary: seed by seed over the points, with a lower and an upper bound among
    # them: undetermined
    summary = by_point[SUMMARY]
    assert summary.curves.bound == "?" and summary.per_seed[0].bound == "?"
    assert summary.curves.text() == "bounded both ways"
    # beside it, the law's multipliers as before
    assert rows[0].law_at_loss.value > 0 and set(fits) == {"scale=baseline", "scale=unified"}


def test_a_seed_without_a_reference_run_on_its_rung_is_said_so(tmp_path):
    dirs = write_ladder(tmp_path)
    dirs.append(write_run(tmp_path, "l1-unified-tpp5-s7", "unified", "l1", 7, 5,
                          evals([(0, 9.0), (200, 4.2)])))
    series = efficiency_series([load_run_dir(d) for d in dirs])
    rows, _ = compute_efficiency(series, find_reference(series, "scale=baseline"), bootstrap=5)
    row = next(r for r in rows if r.point == "model=l1 train.steps=20")
    assert row.per_seed[7] is None and row.runs == 3
    # the mean is over the seeds that have a pair
    assert_reading(row.curves, Reading(math.sqrt(math.sqrt(3) * 2 ** (15 / 16) / 2)))


def test_runs_the_multiplier_cannot_pair_are_refused(tmp_path):
    dirs = write_ladder(tmp_path)
    twin = write_run(tmp_path / "twin", "l1-unified-tpp5-s0", "unified", "l1", 0, 5,
                     evals([(0, 9.0), (200, 4.0)]))
    with pytest.raises(ScalevecError, match="model=l1 train.steps=20: holds two runs of one seed"):
        efficiency_series([load_run_dir(d) for d in [*dirs, twin]])
    untrained = write_run(tmp_path, "l3-baseline", "baseline", "l1", 0, 2.5, evals([(0, 9.0)]))
    with pytest.raises(ScalevecError, match="its last `val_loss` is at 0 tokens"):
        efficiency_series([load_run_dir(untrained)])


def test_a_strategy_lower_at_equal_compute_never_reads_below_1():
    """Random reference curves (trunks and branches that end lower), random strategy points within
    their compute: the multiplier is above 1 exactly where the point lies below the envelope at its
    compute, here drawn independently as the running minimum interpolated linearly in
    log compute."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        curves = []
        for _ in range(rng.integers(1, 4)):
            compute = np.sort(rng.uniform(1e3, 1e6, rng.integers(2, 8)))
            curves.append((compute, 5.0 - np.cumsum(rng.uniform(-0.1, 0.5, compute.size))))
        pooled = np.concatenate([c for c, _ in curves])
        order = np.argsort(pooled)
        envelope = np.minimum.accumulate(np.concatenate([v for _, v in curves])[order])
        for _ in range(20):
            c = rng.uniform(pooled.min(), pooled.max())
            at_c = np.interp(np.log(c), np.log(pooled[order]), envelope)
            loss = at_c + rng.uniform(-0.5, 0.5)
            reading = read_multiplier(curves, c, loss)
            if loss < at_c:
                assert reading.value > 1 and reading.bound in (EXACT, ABOVE)
            else:
                assert reading.value <= 1 + 1e-12 and reading.bound in (EXACT, AT_MOST)


def test_geometric_mean_of_readings():
    assert_reading(geometric_mean([Reading(2.0), Reading(8.0)]), Reading(4.0))
    assert_reading(geometric_mean([Reading(2.0), Reading(8.0, ABOVE)]), Reading(4.0, ABOVE))
    assert_reading(geometric_mean([Reading(2.0, AT_MOST), Reading(8.0)]), Reading(4.0, AT_MOST))
    assert geometric_mean([Reading(2.0, AT_MOST), Reading(8.0, ABOVE)]).bound == "?"
    assert Reading(1.23456, ABOVE).text() == "> 1.235" and Reading(0.5).text() == "0.500"


def test_the_law_is_fitted_with_a_floor_of_zero():
    """Points whose free least-squares fit has E < 0 (they follow -1 + 8 C^-0.05 exactly): the fit
    keeps E >= 0 and is the best such law, against a brute-force search over E >= 0 and alpha (A by
    least squares for each pair); its rmse is the root mean square of the points' loss minus
    the law."""
    c = np.array([1e10, 1e11, 1e12, 1e13, 1e14])
    y = -1.0 + 8.0 * c ** -0.05
    free = np.linalg.lstsq(np.stack([np.ones_like(c), c ** -0.05], 1), y, rcond=None)[0]
    assert free[0] == pytest.approx(-1.0)  # the free fit: exact at alpha 0.05, with E = -1
    fit = fit_power_law(c, y)
    assert fit.E >= 0
    assert fit.rmse == pytest.approx(math.sqrt(np.mean((y - fit(c)) ** 2)), rel=1e-9)
    x = ((c / np.exp(np.log(c).mean()))[None, None, :]
         ** -np.linspace(0.001, 1.0, 1000)[:, None, None])
    e = np.linspace(0.0, y.min(), 200)[None, :, None]
    a = np.sum(x * (y - e), axis=2, keepdims=True) / np.sum(x * x, axis=2, keepdims=True)
    best = float(np.min(np.sum((y - e - a * x) ** 2, axis=2)))
    assert fit.rmse ** 2 * len(y) <= best * (1 + 1e-9)
    assert fit.rmse > 1e-3  # no law with E >= 0 passes through these points


@pytest.mark.parametrize("e, a, alpha",
                         [(0.0, 5.0, 0.1037), (1e-3, 40.0, 0.2513), (2.3, 900.0, 0.3127)])
def test_exact_points_give_back_their_law(e, a, alpha):
    c = np.array([3e10, 1e11, 6e11, 2e12, 1.8e13])
    fit = fit_power_law(c, e + a * c ** -alpha)
    assert fit.E >= 0
    assert (fit.E, fit.A, fit.alpha) == pytest.approx((e, a, alpha), rel=1e-6, abs=1e-9)
    assert fit.rmse < 1e-9


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the analysis extra)")
def test_compare_runs_writes_both_multipliers(tmp_path):
    cli = load_script(REPO / "scripts" / "compare_runs.py")
    out = tmp_path / "out"
    assert cli.main([*map(str, write_ladder(tmp_path / "runs")), "--efficiency", "--reference",
                     "scale=baseline", "--out", str(out), "--bootstrap", "20"]) == 0
    rows = {(r["series"], r["point"]): r for r in csv.DictReader((out / "efficiency.csv").open())}
    row = rows["scale=unified", "model=l1 train.steps=20"]
    assert (float(row["curves_s0"]) == pytest.approx(math.sqrt(3), rel=1e-12)
            and row["curves_s0_bound"] == "")
    assert rows["scale=unified", "model=l1 train.steps=40"]["curves_s0_bound"] == ">"
    # the reference's points carry their residuals against its law, and no multiplier
    ref = rows["scale=baseline", "model=l1 train.steps=20"]
    assert ref["is_reference"] == "True" and ref["curves"] == "" and ref["law_at_loss"] == ""
    assert (float(ref["law_residual"])
            == pytest.approx(float(ref["terminal_loss"]) - float(ref["law"]), abs=1e-12))
    text = (out / "efficiency.md").read_text()
    assert "| multiplier from ref's curves, per seed | multiplier from ref's curves |" in text
    assert ("| scale=unified | model=l1 train.steps=20 | 2 | 2000 | 4.3250 | s0 1.732, s1 0.958 "
            "| 1.288 |" in text)
    assert ("| scale=unified | model=l1 train.steps=40 | 2 | 4000 | 4.1250 | s0 > 1.000, s1 0.931 "
            "| > 0.965 |" in text)
    assert "residual: loss - law" in text and (out / "efficiency.png").stat().st_size > 10_000

"""The trend of a multiplier over a ladder (scalevec_analysis/trend.py) on synthetic curves with a
known answer: the reference's loss is L_R(C) = A C^(-alpha) along every trunk, and the strategy's
point at compute C has the loss L_R(M C) with M = k (C / C0)^b times a per-seed factor, so the
multiplier read from the curves is M, its elasticity b, and the strategy's law L_R(k C^(1+b)) has
the exponent alpha (1 + b)."""

import math
from dataclasses import replace

import numpy as np
import pytest

from scalevec_analysis import compute_efficiency, efficiency_series
from scalevec_analysis.efficiency import find_reference
from scalevec_analysis.runs import Run
from scalevec_analysis.trend import (
    Interval,
    exponent_difference,
    fit_trend,
    head_shares,
    trend_markdown,
    trend_points,
)

A, ALPHA, K, B, C0 = 1000.0, 0.2, 1.1, 0.04, 1e14
VOCAB = 4096
# dim, FLOPs per token
RUNGS = {"l1": (32, 3e6), "l2": (64, 1e7), "l3": (96, 3e7), "l4": (128, 9e7)}
BUDGETS = (2.5, 5.0, 10.0)
NOISE = (-0.05, 0.0, 0.05)  # log M per seed: the seeds' geometric mean is M itself


def law(compute):
    return A * np.asarray(compute, dtype=np.float64) ** -ALPHA


def tokens(rung: str, budget: float) -> float:
    return budget * RUNGS[rung][1] / 6 * 1.5  # a stand-in for N: any tokens that grow with the rung


def run(scale: str, rung: str, budget: float, seed: int, records: list[dict]) -> Run:
    dim, flops = RUNGS[rung]
    config = {"model.name": rung, "model.dim": dim, "model.vocab_size": VOCAB, "scale.name": scale,
              "train.tokens_per_param": budget, "seed": seed}
    return Run(f"{rung}-{scale}-{budget}-s{seed}", config, records, flops_per_token=flops)


def ladder() -> list[Run]:
    runs = []
    for rung, (_, flops) in RUNGS.items():
        for seed, noise in enumerate(NOISE):
            # the reference's trunk: 200 evaluations to 10 tokens per parameter
            t = np.geomspace(tokens(rung, 10.0) / 100, tokens(rung, 10.0), 200)
            runs.append(run("baseline", rung, 10.0, seed, [{"step": i + 1, "tokens": float(x),
                                                           "val_loss": float(law(flops * x))}
                                                          for i, x in enumerate(t)]))
            for budget in BUDGETS:
                c = flops * tokens(rung, budget)
                m = K * (c / C0) ** B * math.exp(noise)
                end = tokens(rung, budget)
                runs.append(run("unified", rung, budget, seed, [
                    {"step": 1, "tokens": end / 2, "val_loss": 9.0},
                    {"step": 2, "tokens": end, "val_loss": float(law(m * c))}]))
    return runs


@pytest.fixture(scope="module")
def analysed():
    runs = ladder()
    series = efficiency_series(runs)
    reference = find_reference(series, "scale=baseline")
    strategy = next(s for s in series if s is not reference)
    rows, _ = compute_efficiency(series, reference, bootstrap=50)
    return runs, series, reference, strategy, trend_points(rows, strategy, head_shares(runs))


def test_the_known_slope_is_recovered_with_an_interval_that_covers_it(analysed):
    _, _, _, _, points = analysed
    # the reference's trunk reaches the strategy's loss at 2.5 and 5, never at 10 (M C beyond
    # its end)
    assert (all(p.exact for p in points if p.budget < 10)
            and not any(p.exact for p in points if p.budget == 10))
    for budgets in ((2.5,), (5.0,), (2.5, 5.0)):
        t = fit_trend(points, budgets, bootstrap=400)
        assert t.slope.value == pytest.approx(B, abs=2e-3), budgets
        assert t.slope.low <= B <= t.slope.high and t.slope.high - t.slope.low < 0.1
        assert len(t.fitted) == 4 * len(budgets) and t.bounded == []
    # every point at 10 is a bound: no trend is read there
    assert fit_trend(points, (10.0,)) is None
    # pooled over every budget: 10's points, all bounds, are left out with their budget
    pooled = fit_trend(points, (2.5, 5.0, 10.0), bootstrap=100)
    assert pooled.budgets == (2.5, 5.0) and pooled.slope.value == pytest.approx(B, abs=2e-3)
    assert (sorted(p.rung for p in pooled.bounded) == sorted(RUNGS)
            and {p.budget for p in pooled.bounded} == {10.0})
    # the pooled trend carried to 10x the largest rung's compute: M there, by the closed form
    t = fit_trend(points, (2.5, 5.0), bootstrap=400)
    far = 10 * max(p.compute for p in points)
    predicted = t.predict(far, 2.5)
    expected = K * (far / C0) ** B
    assert predicted.value == pytest.approx(expected, rel=0.02)
    assert predicted.low <= expected <= predicted.high


def test_head_shares_and_the_exponents_difference(analysed):
    runs, _, reference, strategy, points = analysed
    shares = head_shares(runs)
    assert shares == pytest.approx({rung: 6 * VOCAB * dim / flops
                                    for rung, (dim, flops) in RUNGS.items()})
    # only the strategy's points at 2.5 and 5 follow L_R(k C^(1+b)); the reference's trunks,
    # L_R itself
    exact = type(strategy)(strategy.label, strategy.config,
                           [p for p in strategy.points
                            if dict(p.key)["train.tokens_per_param"] < 10])
    diff = exponent_difference(exact, reference, bootstrap=200)
    assert diff.value == pytest.approx(ALPHA * B, abs=1e-3)
    assert diff.low <= ALPHA * B <= diff.high
    text = trend_markdown(points, {"2.5": fit_trend(points, (2.5,), bootstrap=50)}, diff)
    assert "| l4 | " in text and "> " in text  # the bounds at 10 are shown as bounds
    # the stable phase: M(5) / M(2.5) = 2^b on every seed
    assert f"| l2 | {2 ** B:.3f} | {2 ** B:.3f} | {2 ** B:.3f} |" in text


def test_the_table_goes_rung_by_rung_with_budgets_ascending(analysed):
    """A trunk's steps are rounded (dense-l3: 439, 878 and 1755 steps), so a rung's compute is not
    exactly proportional to its budget: the rows still go rung by rung, budgets ascending."""
    points = [replace(p, compute=p.compute * 0.999) if (p.rung, p.budget) == ("l3", 10.0) else p
              for p in analysed[-1]]
    text = trend_markdown(points, {}, Interval(0.0, -1.0, 1.0))
    table = text.split("\n\n")[1].splitlines()[2:]
    assert [row.split(" | ")[0][2:] + "/" + row.split(" | ")[2] for row in table] == [
        f"{rung}/{budget:g}" for rung in RUNGS for budget in BUDGETS]

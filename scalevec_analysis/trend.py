"""Does a strategy's compute multiplier grow, hold or fade as the model grows? Its trend over
a ladder.

The multipliers are the efficiency module's readings from the reference's measured curves, seed by
seed at each rung and budget (tokens per parameter). The trend is the elasticity b of
M(C) = k_budget C^b, fitted by least squares on log M against log C over the points whose every seed
reads exactly: per budget (k one constant), or pooled over the budgets (one b, a k per budget, so
that the budgets' levels do not pass for a trend). b > 0: the multiplier grows with compute. A point
with a bound among its seeds ("> x": the reference never gets there within its longest budget) stays
a bound: it is listed, not fitted. Intervals: percentile bootstrap (2.5%, 97.5%) over seeds, each
point's exact readings resampled with replacement, their geometric mean refitted.

Beside it: each rung's head share (6 V D of the training FLOPs per token: the output head, which no
scale site touches, and which dominates the smallest rungs), so that the trend can be read again
over the rungs whose blocks carry most of the compute; the stable phase (the multiplier at a rung's
two WSD budgets, seed by seed); and the fitted laws' exponents, the strategy's minus the
reference's, with the same bootstrap (a positive difference: the strategy's loss falls faster
with compute).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scalevec_analysis.efficiency import SUMMARY, EfficiencyRow, Series
from scalevec_analysis.envelope import EXACT, Reading
from scalevec_analysis.runs import Run
from scalevec_train.infra.errors import ScalevecError


@dataclass
class TrendPoint:
    rung: str  # model.name
    budget: float  # train.tokens_per_param
    compute: float  # the strategy point's mean compute (FLOPs)
    head_share: float  # of the training FLOPs per token
    readings: dict  # seed -> Reading, from the reference's curves

    @property
    def exact(self) -> bool:
        return (bool(self.readings)
                and all(r is not None and r.bound == EXACT for r in self.readings.values()))

    def log_values(self) -> np.ndarray:
        return np.log([r.value for r in self.readings.values()])


@dataclass
class Interval:
    value: float
    low: float
    high: float

    def text(self, spec: str = "+.3f") -> str:
        return f"{format(self.value, spec)} [{format(self.low, spec)}, {format(self.high, spec)}]"


@dataclass
class Trend:
    budgets: tuple[float, ...]  # the budgets fitted (one: per budget; several: pooled)
    slope: Interval  # b, the elasticity of the multiplier in compute
    fitted: list[TrendPoint]
    bounded: list[TrendPoint]  # left out: a bound among their seeds
    coefs: np.ndarray  # (b, k per budget) of the fit
    draws: np.ndarray  # the same per bootstrap resample

    def predict(self, compute: float, budget: float) -> Interval:
        """M at `compute` for `budget` if the trend held there: an extrapolation beyond
        the ladder."""
        j = 1 + self.budgets.index(budget)
        value = math.exp(self.coefs[j] + self.coefs[0] * math.log(compute))
        samples = np.exp(self.draws[:, j] + self.draws[:, 0] * math.log(compute))
        low, high = np.quantile(samples, [0.025, 0.975])
        return Interval(value, float(low), float(high))


def head_shares(runs: Sequence[Run]) -> dict[str, float]:
    """{model name: 6 V D over the run's training FLOPs per token} (the head's matmul forward
    and back)."""
    out = {}
    for run in runs:
        vocab, dim = run.config.get("model.vocab_size"), run.config.get("model.dim")
        if run.flops_per_token and vocab and dim:
            out[run.config["model.name"]] = 6 * vocab * dim / run.flops_per_token
    return out


def trend_points(rows: Sequence[EfficiencyRow], strategy: Series,
                 shares: dict[str, float]) -> list[TrendPoint]:
    """The strategy's points with their per-seed readings (compute_efficiency's rows of
    that series)."""
    by_label = {r.point: r for r in rows if r.series == strategy.label and r.point != SUMMARY}
    out = []
    for p in strategy.points:
        config = dict(p.key)
        rung = config.get("model.name")
        if rung not in shares:
            raise ScalevecError(f"point {p.label}",
                                "has no model.name, vocabulary or FLOPs per token.",
                                "pass run directories written by the trainer (config.yaml, "
                                "describe.json).")
        out.append(TrendPoint(rung, float(config.get("train.tokens_per_param") or 0.0), p.compute,
                              shares[rung], dict(by_label[p.label].per_seed)))
    return out


def _fit(points: Sequence[TrendPoint], budgets: tuple[float, ...],
         logs: Sequence[np.ndarray]) -> np.ndarray:
    x = np.array([[math.log(p.compute)] + [float(p.budget == b) for b in budgets] for p in points])
    y = np.array([v.mean() for v in logs])
    return np.linalg.lstsq(x, y, rcond=None)[0]


def fit_trend(points: Sequence[TrendPoint], budgets: Sequence[float], bootstrap: int = 1000,
              seed: int = 0) -> Trend | None:
    """b over the exact points of `budgets` (one budget, or several pooled), each budget with at
    least two exact points of distinct compute (the others' points are left out with the bounds);
    None where none has."""
    chosen = [p for p in points if p.budget in budgets]
    exact = [p for p in chosen if p.exact]
    budgets = tuple(b for b in budgets if len({p.compute for p in exact if p.budget == b}) >= 2)
    if not budgets:
        return None
    fitted = [p for p in exact if p.budget in budgets]
    coefs = _fit(fitted, budgets, [p.log_values() for p in fitted])
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(bootstrap):
        logs = [v[rng.integers(0, len(v), len(v))] for v in (p.log_values() for p in fitted)]
        draws.append(_fit(fitted, budgets, logs))
    draws = np.array(draws)
    low, high = np.quantile(draws[:, 0], [0.025, 0.975])
    return Trend(budgets, Interval(float(coefs[0]), float(low), float(high)), fitted,
                 [p for p in chosen if p not in fitted], coefs, draws)


def exponent_difference(strategy: Series, reference: Series, bootstrap: int = 1000,
                        seed: int = 0) -> Interval:
    """alpha of the strategy's law minus the reference's (L(C) = E + A C^(-alpha), E >= 0), with the
    bootstrap over seeds (every point's runs resampled, both laws refitted)."""
    value = strategy.fit().alpha - reference.fit().alpha
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        alphas = [s.fit([p.losses[rng.integers(0, len(p.losses), len(p.losses))].mean()
                         for p in s.points]).alpha
                  for s in (strategy, reference)]
        samples.append(alphas[0] - alphas[1])
    low, high = np.quantile(samples, [0.025, 0.975])
    return Interval(value, float(low), float(high))


def _reading(r: Reading | None) -> str:
    return "no reference run" if r is None else r.text()


def trend_markdown(points: Sequence[TrendPoint], trends: dict[str, Trend | None],
                   exponents: Interval,
                   predictions: Sequence[tuple[str, float, float]] = ()) -> str:
    """The per-seed multipliers with each rung's head share, the stable phase, the slopes, the
    exponents' difference and any extrapolation (label, compute, budget)."""
    seeds = sorted({s for p in points for s in p.readings}, key=str)
    rows = ["Multiplier from the reference's curves per rung, budget and seed (`> x`: a bound), "
            "with the head's share of the training FLOPs per token:\n",
            "| rung | head share | tokens per parameter | compute (FLOPs) | "
            + " | ".join(f"seed {s}" for s in seeds)
            + " |", "|---|---:|---:|---:|" + "---:|" * len(seeds)]
    # rung by rung (in the order of their smallest compute), budgets ascending: a trunk's steps
    # are rounded, so compute over budget differs by a hair between a rung's budgets
    first: dict[str, float] = {}
    for p in sorted(points, key=lambda p: p.compute):
        first.setdefault(p.rung, p.compute)
    for p in sorted(points, key=lambda p: (first[p.rung], p.budget)):
        rows.append(f"| {p.rung} | {p.head_share:.0%} | {p.budget:g} | {p.compute:.4g} | "
                    + " | ".join(_reading(p.readings.get(s)) for s in seeds) + " |")
    rows += ["\nThe stable phase: the multiplier at a rung's 5 tokens per parameter over its 2.5, "
             "seed by seed (> 1: the gain widens as the stable phase goes on):\n",
             "| rung | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---:|" * len(seeds)]
    for rung in dict.fromkeys(p.rung for p in sorted(points, key=lambda p: p.compute)):
        at = {p.budget: p for p in points if p.rung == rung}
        if 2.5 in at and 5.0 in at:
            cells = []
            for s in seeds:
                a, b = at[2.5].readings.get(s), at[5.0].readings.get(s)
                exact = a is not None and b is not None and a.bound == b.bound == EXACT
                cells.append(f"{b.value / a.value:.3f}" if exact else "bound")
            rows.append(f"| {rung} | " + " | ".join(cells) + " |")
    rows += ["\nThe trend: b in M ~ C^b (log M against log C, exact points only; pooled: one b, a "
             "level per budget), 95% bootstrap interval over seeds:\n",
             "| fit | b | points fitted | left out (a bound among the seeds, or no trend at its "
             "budget) |", "|---|---|---:|---|"]
    for label, t in trends.items():
        if t is None:
            rows.append(f"| {label} | not enough exact points | | |")
            continue
        left = ", ".join(f"{p.rung}/{p.budget:g}" for p in t.bounded) or "none"
        rows.append(f"| {label} | {t.slope.text()} | {len(t.fitted)} | {left} |")
    rows.append("\nThe laws' exponents, the strategy's alpha minus the reference's: "
                f"{exponents.text('+.4f')} (95% bootstrap interval over seeds).")
    if predictions:
        rows += ["\nExtrapolations (the pooled trend carried beyond the ladder; not a "
                 "measurement):\n",
                 "| at | compute (FLOPs) | tokens per parameter | multiplier if the trend held |",
                 "|---|---:|---:|---|"]
        pooled = trends.get("pooled")
        for label, compute, budget in predictions:
            text = ("no pooled trend at this budget"
                    if pooled is None or budget not in pooled.budgets
                    else pooled.predict(compute, budget).text(".3f"))
            rows.append(f"| {label} | {compute:.4g} | {budget:g} | {text} |")
    return "\n".join(rows) + "\n"

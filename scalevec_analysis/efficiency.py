"""Compute efficiency of strategies against a reference over a ladder of runs.

Each run is a point (C, L): C its training compute, train_flops_per_token (describe.json: 6 N plus
attention, as the trainer counts it) times its tokens, L its terminal loss. Runs split into series by the
strategy keys (default the `scale` section) and, within a series, into points by everything else but the
seed (the model size, the budget); a point's C and L are the means over its runs (seeds). Each series is
fitted with L(C) = E + A C^(-alpha) (`fit_power_law`), so the compute at which the reference reaches a loss
L is C_R(L) = (A_R / (L - E_R))^(1/alpha_R), "not reached" (inf) when L <= E_R.

The *compute multiplier* of a strategy point (C, L) is C_R(L) / C: how much more compute the reference
needs to reach the strategy's loss; above 1 the strategy is more compute-efficient. *Measured* takes the
point's own mean loss; *from the fits* takes the strategy's fitted loss at C, L_S(C). Per series, the
geometric mean over its points summarizes both. Intervals: percentile bootstrap (2.5%, 97.5%) over seeds,
resampling the runs of every point of every series (the reference's too) with replacement and refitting.
"""

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scalevec_analysis.groups import Group, comparable_config, config_labels, find_group, in_sections, metric_curve
from scalevec_analysis.runs import Run
from scalevec_analysis.scaling import PowerLawFit, fit_power_law
from scalevec_train.errors import ScalevecError

SUMMARY = "all points (geometric mean)"


@dataclass
class Point:
    """The runs of one series that differ only in the seed: their mean compute and terminal losses."""

    label: str
    key: tuple  # the point's config without the series keys: matches points across series
    compute: float  # mean over runs of train_flops_per_token * terminal tokens
    losses: np.ndarray  # terminal loss per run


@dataclass
class Series:
    label: str
    config: dict[str, Any]  # the strategy keys
    points: list[Point]  # by compute, ascending

    def fit(self, losses: Sequence[float] | None = None) -> PowerLawFit:
        means = [p.losses.mean() for p in self.points] if losses is None else losses
        return fit_power_law([p.compute for p in self.points], means)


@dataclass
class Multiplier:
    """A multiplier with its bootstrap interval; inf: the reference never reaches the loss."""

    value: float
    low: float
    high: float


@dataclass
class EfficiencyRow:
    series: str
    point: str  # a point label, or SUMMARY
    runs: int
    compute: float | None  # None for the summary
    loss: float | None
    reference_compute: float | None
    measured: Multiplier
    fitted: Multiplier


def reference_compute(fit: PowerLawFit, loss: float) -> float:
    """C_R(loss): the compute at which the fitted law reaches `loss`; inf where it never does."""
    if fit.A <= 0 or loss <= fit.E:
        return math.inf
    return float((fit.A / (loss - fit.E)) ** (1.0 / fit.alpha))


def efficiency_series(runs: Sequence[Run], metric: str = "val_loss", last_k: int = 1,
                      series_keys: Sequence[str] = ("scale",), ignore: Sequence[str] = ()) -> list[Series]:
    """Runs -> series (by the strategy keys) of points (by everything else but the seed and bookkeeping)."""
    grouped: dict[tuple, dict[tuple, list[Run]]] = {}
    for run in runs:
        if run.flops_per_token is None:
            raise ScalevecError(run.name, "no training FLOPs per token for its compute.",
                                "keep the trainer's describe.json (train_flops_per_token) in the run directory.")
        config = comparable_config(run, ignore)
        strategy = tuple(sorted((k, v) for k, v in config.items() if in_sections(k, series_keys)))
        point = tuple(sorted((k, v) for k, v in config.items() if not in_sections(k, series_keys)))
        grouped.setdefault(strategy, {}).setdefault(point, []).append(run)
    point_keys = list(dict.fromkeys(p for points in grouped.values() for p in points))
    point_labels = dict(zip(point_keys, config_labels([dict(k) for k in point_keys]), strict=True))
    out = []
    for label, (strategy, points) in zip(config_labels([dict(k) for k in grouped]), grouped.items(), strict=True):
        made = []
        for key, members in points.items():
            ends = [metric_curve(r, metric, last_k) for r in members]
            compute = float(np.mean([r.flops_per_token * t[-1] for r, (t, _) in zip(members, ends, strict=True)]))
            made.append(Point(point_labels[key], key, compute, np.array([v[-1] for _, v in ends])))
        out.append(Series(label, dict(strategy), sorted(made, key=lambda p: p.compute)))
    return out


def _multipliers(reference: PowerLawFit, fit: PowerLawFit, computes: np.ndarray,
                 losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    measured = np.array([reference_compute(reference, loss) for loss in losses]) / computes
    fitted = np.array([reference_compute(reference, float(fit(c))) for c in computes]) / computes
    return measured, fitted


def _geometric_mean(values: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(values)))) if np.all(np.isfinite(values)) else math.inf


def _interval(samples: np.ndarray) -> tuple[float, float]:
    # an element of the samples (no interpolation), so that "not reached" (inf) stays inf
    low, high = np.quantile(samples, [0.025, 0.975], method="inverted_cdf")
    return float(low), float(high)


def compute_efficiency(series: Sequence[Series], reference: Series, bootstrap: int = 1000,
                       seed: int = 0) -> tuple[list[EfficiencyRow], dict[str, PowerLawFit]]:
    """Multipliers of every non-reference series' points and their summary, with bootstrap intervals;
    and every series' fit."""
    for s in series:
        if len({p.compute for p in s.points}) < 3:
            raise ScalevecError(f"series {s.label!r}", f"has {len(s.points)} points of distinct compute; the fit "
                                "L(C) = E + A C^(-alpha) needs at least 3.", "run more ladder sizes.")
    fits = {s.label: s.fit() for s in series}
    rng = np.random.default_rng(seed)
    draws: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s.label: [] for s in series if s is not reference}
    for _ in range(bootstrap):
        resampled = {s.label: [p.losses[rng.integers(0, len(p.losses), len(p.losses))].mean() for p in s.points]
                     for s in series}
        ref_fit = reference.fit(resampled[reference.label])
        for s in series:
            if s is not reference:
                computes = np.array([p.compute for p in s.points])
                draws[s.label].append(_multipliers(ref_fit, s.fit(resampled[s.label]), computes,
                                                   np.array(resampled[s.label])))
    rows = []
    for s in series:
        if s is reference:
            continue
        computes = np.array([p.compute for p in s.points])
        losses = np.array([p.losses.mean() for p in s.points])
        measured, fitted = _multipliers(fits[reference.label], fits[s.label], computes, losses)
        boot_m = np.array([m for m, _ in draws[s.label]]).reshape(bootstrap, len(s.points))
        boot_f = np.array([f for _, f in draws[s.label]]).reshape(bootstrap, len(s.points))
        for i, p in enumerate(s.points):
            rows.append(EfficiencyRow(
                s.label, p.label, len(p.losses), p.compute, float(losses[i]),
                reference_compute(fits[reference.label], float(losses[i])),
                Multiplier(float(measured[i]), *_interval(boot_m[:, i])),
                Multiplier(float(fitted[i]), *_interval(boot_f[:, i]))))
        rows.append(EfficiencyRow(
            s.label, SUMMARY, sum(len(p.losses) for p in s.points), None, None, None,
            Multiplier(_geometric_mean(measured), *_interval(np.array([_geometric_mean(m) for m in boot_m]))),
            Multiplier(_geometric_mean(fitted), *_interval(np.array([_geometric_mean(f) for f in boot_f])))))
    return rows, fits


def find_reference(series: Sequence[Series], spec: str) -> Series:
    """The series `spec` names: its label or key=value terms (`find_group`'s rules)."""
    groups = [Group(s.label, s.config, []) for s in series]
    return series[groups.index(find_group(groups, spec))]


# ----------------------------------------------------------------------------------------------- tables


def _x(m: float) -> str:
    return "not reached" if math.isinf(m) else f"{m:.3f}"


def _g(value: float | None, spec: str) -> str:
    if value is None:
        return ""
    return "not reached" if math.isinf(value) else format(value, spec)


def efficiency_markdown(rows: Sequence[EfficiencyRow], fits: dict[str, PowerLawFit], reference: str,
                        bootstrap: int) -> str:
    fit_table = "| series | E | A | alpha | rmse |\n|---|---|---|---|---|\n" + "".join(
        f"| {label}{' (ref)' if label == reference else ''} | {f.E:.4f} | {f.A:.4g} | {f.alpha:.4f} | {f.rmse:.2e} |\n"
        for label, f in fits.items())
    head = ("| series | point | runs | compute (FLOPs) | terminal loss | ref compute to reach | multiplier, measured "
            f"| 95% interval | multiplier, from the fits | 95% interval |\n|{'---|' * 10}\n")
    body = "".join(
        f"| {r.series} | {r.point} | {r.runs} | {_g(r.compute, '.4g')} | {_g(r.loss, '.4f')} "
        f"| {_g(r.reference_compute, '.4g')} | {_x(r.measured.value)} | [{_x(r.measured.low)}, {_x(r.measured.high)}] "
        f"| {_x(r.fitted.value)} | [{_x(r.fitted.low)}, {_x(r.fitted.high)}] |\n" for r in rows)
    note = (f"\nReference: {reference}. Multiplier: the reference's compute to reach the loss / the strategy's "
            f"compute (>1: the strategy needs less). Intervals: bootstrap over seeds, {bootstrap} resamples.\n")
    return fit_table + "\n" + head + body + note


def write_efficiency_csv(rows: Sequence[EfficiencyRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "point", "runs", "compute", "terminal_loss", "reference_compute", "measured",
                    "measured_low", "measured_high", "fitted", "fitted_low", "fitted_high"])
        for r in rows:
            w.writerow([r.series, r.point, r.runs, "" if r.compute is None else repr(r.compute),
                        "" if r.loss is None else repr(r.loss),
                        "" if r.reference_compute is None else repr(r.reference_compute),
                        *(repr(x) for m in (r.measured, r.fitted) for x in (m.value, m.low, m.high))])

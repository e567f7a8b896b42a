"""Compute efficiency of strategies against a reference over a ladder of runs.

Each run is a point (C, L): C its training compute, train_flops_per_token (describe.json: 6 N plus
attention, as the trainer counts it) times its tokens, L its terminal loss. Runs split into series
by the strategy keys (default the `scale` section) and, within a series, into points by everything
else but the seed (the model size, the budget); a point's C and L are the means over its runs
(seeds). A point's *rung* is its config without the keys a WSD branch may change from its trunk (the
run's length, train.steps and train.tokens_per_param, and schedule.*; checkpoint.* and branch_from
never group).

The *compute multiplier* of a strategy point (C, L) is C_R(L) / C: the compute the reference needs
to reach the strategy's loss over the strategy's compute; above 1 the strategy is more
compute-efficient. It is read two ways:

- *from the reference's curves* (`scalevec_analysis.envelope`): seed by seed, the strategy run of
  seed s against every evaluation of the reference's seed-s runs on the same rung (its trunk and
  branches), C_R where their lower envelope reaches the run's terminal loss, over the run's own
  compute; a bound where the reference never gets there within its longest budget ("> x") or is
  already there at its first evaluation ("<= x"). A point's reading is the geometric mean over its
  seeds (a bound when any seed's is one). No model: it holds only where the reference has
  been measured.
- *from the reference's law*: each series fitted with L(C) = E + A C^(-alpha), E >= 0
  (`fit_power_law`), C_R(L) = (A_R / (L - E_R))^(1/alpha_R), "not reached" (inf) when L <= E_R; at
  the point's own mean loss, or at the strategy's fitted loss L_S(C). It reads every point off one
  law across rungs and budgets, beyond the reference's measured points too, and is only as good as
  that law's fit (its residuals: each point's loss minus the law).

Per series, the geometric mean over its points summarizes each. Intervals of the law's multipliers:
percentile bootstrap (2.5%, 97.5%) over seeds, resampling the runs of every point of every series
(the reference's too) with replacement and refitting.
"""

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scalevec_analysis.envelope import Reading, geometric_mean, read_multiplier
from scalevec_analysis.grouping import (
    Group,
    comparable_config,
    config_labels,
    find_group,
    in_sections,
    metric_curve,
)
from scalevec_analysis.runs import Run
from scalevec_analysis.scaling import PowerLawFit, fit_power_law
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run.resume import LENGTH

SUMMARY = "all points (geometric mean)"
# the keys (and sections) a WSD branch may change from its trunk: they tell a rung's budgets apart
BUDGET_KEYS = tuple(k.rstrip(".") for k in LENGTH)


@dataclass
class Point:
    """The runs of one series that differ only in the seed: their mean compute and terminal losses,
    and each run's seed and curve."""

    label: str
    key: tuple  # the point's config without the series keys: matches points across series
    rung: tuple  # the key without the budget keys (LENGTH): a trunk and its branches share it
    compute: float  # mean over runs of train_flops_per_token * terminal tokens
    losses: np.ndarray  # terminal loss per run
    seeds: list[Any]  # per run
    curves: list[tuple[np.ndarray, np.ndarray]]  # per run: (compute, metric) at each evaluation


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
    # from the reference's curves: per seed of the strategy, None where the reference has no run of
    # that seed on the rung; their geometric mean (for the summary: per seed and in all, over
    # the points)
    per_seed: dict[Any, Reading | None]
    curves: Reading | None
    law_compute: float | None  # C_R(loss) on the reference's law
    law_at_loss: Multiplier  # the reference's law at the point's mean loss
    law_at_fit: Multiplier  # the reference's law at the strategy's law at the point's compute


@dataclass
class Residual:
    """A point's mean terminal loss against its own series' law."""

    series: str
    point: str
    runs: int
    compute: float
    loss: float
    law: float

    @property
    def residual(self) -> float:
        return self.loss - self.law


def reference_compute(fit: PowerLawFit, loss: float) -> float:
    """C_R(loss): the compute at which the fitted law reaches `loss`; inf where it never does."""
    if fit.A <= 0 or loss <= fit.E:
        return math.inf
    return float((fit.A / (loss - fit.E)) ** (1.0 / fit.alpha))


def efficiency_series(runs: Sequence[Run], metric: str = "val_loss", last_k: int = 1,
                      series_keys: Sequence[str] = ("scale",),
                      ignore: Sequence[str] = ()) -> list[Series]:
    """Runs -> series (by the strategy keys) of points (by everything else but the seed
    and bookkeeping)."""
    grouped: dict[tuple, dict[tuple, list[Run]]] = {}
    for run in runs:
        if run.flops_per_token is None:
            raise ScalevecError(run.name, "no training FLOPs per token for its compute.",
                                "keep the trainer's describe.json (train_flops_per_token) in the "
                                "run directory.")
        config = comparable_config(run, ignore)
        strategy = tuple(sorted((k, v) for k, v in config.items() if in_sections(k, series_keys)))
        point = tuple(sorted((k, v) for k, v in config.items() if not in_sections(k, series_keys)))
        grouped.setdefault(strategy, {}).setdefault(point, []).append(run)
    point_keys = list(dict.fromkeys(p for points in grouped.values() for p in points))
    point_labels = dict(zip(point_keys, config_labels([dict(k) for k in point_keys]), strict=True))
    out = []
    for label, (strategy, points) in zip(config_labels([dict(k) for k in grouped]), grouped.items(),
                                         strict=True):
        made = []
        for key, members in points.items():
            curves = []
            for run in members:
                tokens, values = metric_curve(run, metric, last_k)
                if tokens[-1] <= 0:
                    raise ScalevecError(run.name, f"its last `{metric}` is at 0 tokens: no compute "
                                        "to measure.", "compare runs that trained.")
                curves.append((run.flops_per_token * tokens, values))
            seeds = [run.config.get("seed") for run in members]
            if len(set(seeds)) < len(seeds):
                raise ScalevecError(f"series {label!r} at {point_labels[key]}",
                                    "holds two runs of one seed "
                                    f"({', '.join(run.name for run in members)}).",
                                    "pass one run per seed and point (a key given to --ignore may "
                                    "hide what sets them apart).")
            made.append(Point(point_labels[key], key,
                              tuple((k, v) for k, v in key if not in_sections(k, BUDGET_KEYS)),
                              float(np.mean([c[-1] for c, _ in curves])),
                              np.array([v[-1] for _, v in curves]), seeds, curves))
        out.append(Series(label, dict(strategy), sorted(made, key=lambda p: p.compute)))
    return out


def _multipliers(reference: PowerLawFit, fit: PowerLawFit, computes: np.ndarray,
                 losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    at_loss = np.array([reference_compute(reference, loss) for loss in losses]) / computes
    at_fit = np.array([reference_compute(reference, float(fit(c))) for c in computes]) / computes
    return at_loss, at_fit


def curve_readings(point: Point, reference: Series) -> dict[Any, Reading | None]:
    """Seed by seed, the point's run against the reference's runs of that seed on the point's rung
    (every evaluation of its trunk and branches); None where the reference has none."""
    readings = {}
    for seed, (compute, values) in zip(point.seeds, point.curves, strict=True):
        curves = [curve for p in reference.points if p.rung == point.rung
                  for s, curve in zip(p.seeds, p.curves, strict=True) if s == seed]
        readings[seed] = (read_multiplier(curves, float(compute[-1]), float(values[-1])) if curves
                          else None)
    return readings


def _mean_reading(readings) -> Reading | None:
    found = [r for r in readings if r is not None]
    return geometric_mean(found) if found else None


def _geometric_mean(values: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(values)))) if np.all(np.isfinite(values)) else math.inf


def _interval(samples: np.ndarray) -> tuple[float, float]:
    # an element of the samples (no interpolation), so that "not reached" (inf) stays inf
    low, high = np.quantile(samples, [0.025, 0.975], method="inverted_cdf")
    return float(low), float(high)


def compute_efficiency(series: Sequence[Series], reference: Series, bootstrap: int = 1000,
                       seed: int = 0) -> tuple[list[EfficiencyRow], dict[str, PowerLawFit]]:
    """Multipliers of every non-reference series' points and their summary (from the reference's
    curves, and from its law with bootstrap intervals); and every series' fit."""
    for s in series:
        if len({p.compute for p in s.points}) < 3:
            raise ScalevecError(f"series {s.label!r}", f"has {len(s.points)} points of distinct "
                                "compute; the fit L(C) = E + A C^(-alpha) needs at least 3.",
                                "run more ladder sizes.")
    fits = {s.label: s.fit() for s in series}
    rng = np.random.default_rng(seed)
    draws: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s.label: [] for s in series
                                                             if s is not reference}
    for _ in range(bootstrap):
        resampled = {s.label: [p.losses[rng.integers(0, len(p.losses), len(p.losses))].mean()
                               for p in s.points]
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
        at_loss, at_fit = _multipliers(fits[reference.label], fits[s.label], computes, losses)
        boot_l = np.array([m for m, _ in draws[s.label]]).reshape(bootstrap, len(s.points))
        boot_f = np.array([f for _, f in draws[s.label]]).reshape(bootstrap, len(s.points))
        readings = [curve_readings(p, reference) for p in s.points]
        means = [_mean_reading(r.values()) for r in readings]
        for i, p in enumerate(s.points):
            rows.append(EfficiencyRow(
                s.label, p.label, len(p.losses), p.compute, float(losses[i]), readings[i], means[i],
                reference_compute(fits[reference.label], float(losses[i])),
                Multiplier(float(at_loss[i]), *_interval(boot_l[:, i])),
                Multiplier(float(at_fit[i]), *_interval(boot_f[:, i]))))
        seeds = list(dict.fromkeys(seed for r in readings for seed in r))
        rows.append(EfficiencyRow(
            s.label, SUMMARY, sum(len(p.losses) for p in s.points), None, None,
            {seed: _mean_reading(r.get(seed) for r in readings) for seed in seeds},
            _mean_reading(means), None,
            Multiplier(_geometric_mean(at_loss),
                       *_interval(np.array([_geometric_mean(m) for m in boot_l]))),
            Multiplier(_geometric_mean(at_fit),
                       *_interval(np.array([_geometric_mean(f) for f in boot_f])))))
    return rows, fits


def fit_residuals(series: Sequence[Series], fits: dict[str, PowerLawFit]) -> list[Residual]:
    """Every point's mean terminal loss against its series' law, series by series."""
    return [Residual(s.label, p.label, len(p.losses), p.compute, float(p.losses.mean()),
                     float(fits[s.label](p.compute))) for s in series for p in s.points]


def find_reference(series: Sequence[Series], spec: str) -> Series:
    """The series `spec` names: its label or key=value terms (`find_group`'s rules)."""
    groups = [Group(s.label, s.config, []) for s in series]
    return series[groups.index(find_group(groups, spec))]


# ------------------------------------------------------------------------------------------- tables


def _x(m: float) -> str:
    return "not reached" if math.isinf(m) else f"{m:.3f}"


def _g(value: float | None, spec: str) -> str:
    if value is None:
        return ""
    return "not reached" if math.isinf(value) else format(value, spec)


def _seeds(per_seed: dict[Any, Reading | None]) -> str:
    return ", ".join(f"s{seed} {'no reference run' if r is None else r.text()}"
                     for seed, r in per_seed.items())


def efficiency_markdown(rows: Sequence[EfficiencyRow], fits: dict[str, PowerLawFit],
                        residuals: Sequence[Residual], reference: str, bootstrap: int) -> str:
    """The fits with their residuals, then the multipliers, with a note saying what each
    column is."""
    worst = {label: max(abs(r.residual) for r in residuals if r.series == label) for label in fits}
    fit_table = ("Fits of L(C) = E + A C^(-alpha), E >= 0, to each series' mean terminal "
                 "losses:\n\n"
                 "| series | E | A | alpha | rmse | largest abs residual |\n"
                 "|---|---|---|---|---|---|\n" + "".join(
                     f"| {label}{' (ref)' if label == reference else ''} | {f.E:.4f} | {f.A:.4g} | "
                     f"{f.alpha:.4f} | {f.rmse:.2e} | {worst[label]:.2e} |\n"
                     for label, f in fits.items()))
    residual_table = ("| series | point | runs | compute (FLOPs) | terminal loss | law | residual: "
                      "loss - law |\n"
                      f"|{'---|' * 7}\n" + "".join(
                          f"| {r.series} | {r.point} | {r.runs} | {r.compute:.4g} | {r.loss:.4f} | "
                          f"{r.law:.4f} | {r.residual:+.4f} |\n" for r in residuals))
    head = ("| series | point | runs | compute (FLOPs) | terminal loss | multiplier from ref's "
            "curves, per seed | multiplier from ref's curves | ref's law: compute to reach "
            "the loss | multiplier from ref's law at the loss | 95% interval "
            f"| multiplier from ref's law at the strategy's law | 95% interval |\n|{'---|' * 12}\n")
    body = "".join(
        f"| {r.series} | {r.point} | {r.runs} | {_g(r.compute, '.4g')} | {_g(r.loss, '.4f')} | "
        f"{_seeds(r.per_seed)} | {'no reference run' if r.curves is None else r.curves.text()} | "
        f"{_g(r.law_compute, '.4g')} | {_x(r.law_at_loss.value)} | [{_x(r.law_at_loss.low)}, "
        f"{_x(r.law_at_loss.high)}] | {_x(r.law_at_fit.value)} | [{_x(r.law_at_fit.low)}, "
        f"{_x(r.law_at_fit.high)}] |\n" for r in rows)
    note = (f"\nReference: {reference}. A multiplier is the compute the reference needs to reach "
            "the strategy's loss over the strategy's compute (>1: the strategy needs less).\n\n"
            "- **From ref's curves** (measured): seed by seed, the strategy run's terminal loss "
            "against every evaluation of the reference's runs of the same seed on the same rung "
            "(its trunk and WSD branches): the compute where their lower envelope (running minimum "
            "of the loss as compute grows) first gets to that loss, log-linear in compute between "
            "evaluations, over the run's own compute. `> x`: the reference never gets there within "
            "its longest budget on the rung (x: its largest compute over the run's); `<= x`: it is "
            "there at its first evaluation. Per point the geometric mean over the seeds, a bound "
            "when any seed's is one; in the summary, per seed and in all, the geometric mean over "
            "the points. No interval: the seeds are shown.\n"
            "- **From ref's law** (modelled): the compute at which the reference's fitted law "
            "(above: one law over every rung and budget) reaches the point's mean loss (at the "
            "loss) or the strategy's own law at the point's compute (at the strategy's law), over "
            "the point's compute; `not reached` at or below the law's E. It extrapolates beyond "
            "the reference's points and is only as good as the residuals above. Intervals: "
            f"bootstrap over seeds (every point's runs resampled, the laws refitted), {bootstrap} "
            "resamples.\n"
            "- Where the two disagree, the curves hold for the point; the law holds only where its "
            "residuals are small against the differences it reads.\n")
    return (fit_table + "\nResiduals:\n\n" + residual_table + "\nMultipliers:\n\n" + head + body
            + note)


def _cell(value: float | None) -> str:
    return "" if value is None else repr(value)


def write_efficiency_csv(rows: Sequence[EfficiencyRow], residuals: Sequence[Residual],
                         reference: str, path: Path) -> None:
    """A row per point of every series (the reference's first, without multipliers) and per
    strategy's summary: its law and residual; the multipliers from the reference's curves (their
    bound: empty when exact, `>`, `<=`, or `?` when bounded both ways; per seed too) and from
    its law."""
    seeds = list(dict.fromkeys(seed for r in rows for seed in r.per_seed))
    law = {(r.series, r.point): r for r in residuals}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "is_reference", "point", "runs", "compute", "terminal_loss", "law",
                    "law_residual", "curves", "curves_bound",
                    *(f"curves_s{s}{b}" for s in seeds for b in ("", "_bound")),
                    "law_reference_compute", "law_at_loss", "law_at_loss_low", "law_at_loss_high",
                    "law_at_fit", "law_at_fit_low", "law_at_fit_high"])
        for r in residuals:
            if r.series == reference:
                w.writerow([r.series, True, r.point, r.runs, repr(r.compute), repr(r.loss),
                            repr(r.law), repr(r.residual)] + [""] * (2 + 2 * len(seeds) + 7))
        for r in rows:
            fit = law.get((r.series, r.point))
            readings = [r.curves, *(r.per_seed.get(s) for s in seeds)]
            w.writerow([r.series, False, r.point, r.runs, _cell(r.compute), _cell(r.loss),
                        "" if fit is None else repr(fit.law),
                        "" if fit is None else repr(fit.residual),
                        *(x for m in readings
                          for x in (("", "") if m is None else (repr(m.value), m.bound))),
                        _cell(r.law_compute),
                        *(repr(x) for m in (r.law_at_loss, r.law_at_fit)
                          for x in (m.value, m.low, m.high))])

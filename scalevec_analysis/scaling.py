"""Scaling fit: L(N) = E + A * N^(-alpha), E >= 0, fitted per strategy (series) to the mean terminal
loss over the runs at each parameter count N (see `fit_power_law`), and its tables."""

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scalevec_analysis.grouping import (
    comparable_config,
    config_labels,
    differing_keys,
    in_sections,
    metric_curve,
)
from scalevec_analysis.runs import Run
from scalevec_train.infra.errors import ScalevecError


@dataclass
class PowerLawFit:
    """L(N) = E + A * N^(-alpha)."""

    E: float
    A: float
    alpha: float
    rmse: float  # root mean square residual over the fitted points

    def __call__(self, n):
        return self.E + self.A * np.power(np.asarray(n, dtype=np.float64), -self.alpha)


@dataclass
class ScalingSeries:
    """One strategy's points: mean terminal loss at each parameter count."""

    label: str
    sizes: np.ndarray  # distinct parameter counts N, ascending
    losses: np.ndarray  # mean terminal loss over the runs at each N
    counts: np.ndarray  # number of runs at each N
    fit: PowerLawFit | None  # None with fewer than 3 sizes


def _profiles(base: np.ndarray, y: np.ndarray,
              alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each alpha the model is linear in (E, A'): the least-squares (residual sum of squares, E,
    A') in closed form, with E >= 0 (no loss has a negative floor): where the free E would be
    negative, the optimum lies on E = 0, with A' by least squares through the origin."""
    x = np.power(base[None, :], -alphas[:, None])
    xc = x - x.mean(axis=1, keepdims=True)
    slope = (xc @ (y - y.mean())) / np.einsum("ij,ij->i", xc, xc)
    intercept = y.mean() - slope * x.mean(axis=1)
    negative = intercept < 0
    slope = np.where(negative, (x @ y) / np.einsum("ij,ij->i", x, x), slope)
    intercept = np.where(negative, 0.0, intercept)
    resid = y[None, :] - intercept[:, None] - slope[:, None] * x
    return np.einsum("ij,ij->i", resid, resid), intercept, slope


def fit_power_law(sizes: Sequence[float], losses: Sequence[float],
                  alpha_max: float = 4.0) -> PowerLawFit:
    """Least-squares fit of L(N) = E + A * N^(-alpha) with E >= 0 and alpha in (0, alpha_max].

    For each alpha, E and A follow by linear least squares (where the free E would be negative,
    E = 0 and A by least squares through the origin); alpha minimises that profile residual: a grid
    search, then ever finer grids between the neighbours of the best point. Exact points of a law
    with E >= 0 give back their E, A, alpha. N is divided by its geometric mean for conditioning.
    """
    n = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if len(np.unique(n)) < 3 or np.any(n <= 0):
        raise ScalevecError("scaling fit", "needs at least 3 distinct positive sizes, got "
                            f"{sorted(set(n))}.", "run more model sizes.")
    n0 = float(np.exp(np.log(n).mean()))
    base = n / n0
    grid = np.linspace(alpha_max / 4000, alpha_max, 4000)
    i = int(np.argmin(_profiles(base, y, grid)[0]))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    while hi - lo > 1e-14 * hi:
        finer = np.linspace(lo, hi, 33)
        i = int(np.argmin(_profiles(base, y, finer)[0]))
        lo, hi = finer[max(i - 1, 0)], finer[min(i + 1, len(finer) - 1)]
    alpha = (lo + hi) / 2
    ssr, e, slope = (float(v[0]) for v in _profiles(base, y, np.array([alpha])))
    # y = E + slope * (N / n0)^(-alpha), so A = slope * n0^alpha.
    return PowerLawFit(E=e, A=slope * n0**alpha, alpha=float(alpha), rmse=math.sqrt(ssr / len(y)))


def scaling_series(runs: Sequence[Run], metric: str = "val_loss", last_k: int = 1,
                   series_keys: Sequence[str] = ("scale",),
                   ignore: Sequence[str] = ()) -> list[ScalingSeries]:
    """Split runs into series by the config keys under `series_keys` (default: the `scale` section,
    i.e. the strategy), average the terminal loss over the runs at each N, and fit each series.

    Runs at the same N in one series must differ only in ignored keys (the seed...), else the points
    would mix different settings: that is an error.
    """
    series: dict[tuple, dict[float, list[Run]]] = {}
    for run in runs:
        if run.params is None:
            raise ScalevecError(run.name, "no parameter count N for the scaling fit.",
                                "keep the trainer's describe.json (total_params) in the run "
                                "directory, or log a `params` value in the metrics.")
        config = comparable_config(run, ignore)
        key = tuple(sorted((k, v) for k, v in config.items() if in_sections(k, series_keys)))
        series.setdefault(key, {}).setdefault(run.params, []).append(run)
    labels = config_labels([dict(k) for k in series])
    out = []
    for label, by_size in zip(labels, series.values(), strict=True):
        sizes = np.array(sorted(by_size))
        losses, counts = [], []
        for size in sizes:
            members = by_size[size]
            configs = [comparable_config(r, ignore) for r in members]
            if len({tuple(sorted(c.items())) for c in configs}) > 1:
                raise ScalevecError(f"series {label!r} at N={size:.6g}",
                                    "its runs differ in more than the seed: "
                                    f"{', '.join(differing_keys(configs))}.",
                                    "pass one set of runs per size, or add those keys to --series.")
            losses.append(np.mean([metric_curve(r, metric, last_k)[1][-1] for r in members]))
            counts.append(len(members))
        fit = fit_power_law(sizes, losses) if len(sizes) >= 3 else None
        out.append(ScalingSeries(label, sizes, np.array(losses), np.array(counts), fit))
    return out


def scaling_markdown(series: Sequence[ScalingSeries]) -> str:
    head = "| series | sizes | runs | E | A | alpha | rmse |\n|---|---|---|---|---|---|---|\n"
    rows = []
    for s in series:
        if s.fit is None:
            fit = "| needs ≥3 sizes | | | |"
        else:
            fit = f"| {s.fit.E:.4f} | {s.fit.A:.4g} | {s.fit.alpha:.4f} | {s.fit.rmse:.2e} |"
        rows.append(f"| {s.label} | {len(s.sizes)} | {int(s.counts.sum())} {fit}\n")
    return head + "".join(rows)


def write_scaling_csv(series: Sequence[ScalingSeries], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "sizes", "runs", "E", "A", "alpha", "rmse"])
        for s in series:
            fit = ["", "", "", ""] if s.fit is None else [repr(s.fit.E), repr(s.fit.A),
                                                          repr(s.fit.alpha), repr(s.fit.rmse)]
            w.writerow([s.label, len(s.sizes), int(s.counts.sum()), *fit])

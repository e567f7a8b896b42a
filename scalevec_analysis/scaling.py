"""Scaling fit: L(N) = E + A * N^(-alpha), fitted per strategy (series) to the mean terminal loss over the
runs at each parameter count N (see `fit_power_law`), and its tables."""

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scalevec_analysis.groups import comparable_config, config_labels, differing_keys, in_sections, metric_curve
from scalevec_analysis.runs import Run
from scalevec_train.errors import ScalevecError


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


def _profile(x_base: np.ndarray, y: np.ndarray, alpha: float) -> tuple[float, float, float]:
    # For a fixed alpha the model is linear in (E, A'): least squares in closed form.
    x = np.power(x_base, -alpha)
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    intercept = float(y.mean() - slope * x.mean())
    resid = y - intercept - slope * x
    return float(resid @ resid), intercept, slope


def fit_power_law(sizes: Sequence[float], losses: Sequence[float], alpha_max: float = 4.0) -> PowerLawFit:
    """Least-squares fit of L(N) = E + A * N^(-alpha) with alpha in (0, alpha_max].

    For each alpha, E and A follow by linear least squares; alpha minimises that profile residual: a
    grid search, then golden-section refinement between the grid neighbours of the best point. Exact
    points give back their E, A, alpha. N is divided by its geometric mean for conditioning.
    """
    n = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if len(np.unique(n)) < 3 or np.any(n <= 0):
        raise ScalevecError("scaling fit", f"needs at least 3 distinct positive sizes, got {sorted(set(n))}.",
                            "run more model sizes.")
    n0 = float(np.exp(np.log(n).mean()))
    base = n / n0
    grid = np.linspace(alpha_max / 4000, alpha_max, 4000)
    # the profile residual of every grid alpha at once (as _profile computes it for one)
    x = np.power(base[None, :], -grid[:, None])
    xc = x - x.mean(axis=1, keepdims=True)
    yc = y - y.mean()
    slope = (xc @ yc) / np.einsum("ij,ij->i", xc, xc)
    ssr = np.sum((yc[None, :] - slope[:, None] * xc) ** 2, axis=1)
    i = int(np.argmin(ssr))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = _profile(base, y, a)[0], _profile(base, y, b)[0]
    for _ in range(200):
        if hi - lo <= 1e-14 * hi:
            break
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = _profile(base, y, a)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = _profile(base, y, b)[0]
    alpha = min((grid[i], a, b), key=lambda x: _profile(base, y, x)[0])
    ssr_best, e, slope = _profile(base, y, alpha)
    # y = E + slope * (N / n0)^(-alpha), so A = slope * n0^alpha.
    return PowerLawFit(E=e, A=slope * n0**alpha, alpha=float(alpha), rmse=math.sqrt(ssr_best / len(y)))


def scaling_series(runs: Sequence[Run], metric: str = "val_loss", last_k: int = 1,
                   series_keys: Sequence[str] = ("scale",),
                   ignore: Sequence[str] = ()) -> list[ScalingSeries]:
    """Split runs into series by the config keys under `series_keys` (default: the `scale` section, i.e.
    the strategy), average the terminal loss over the runs at each N, and fit each series.

    Runs at the same N in one series must differ only in ignored keys (the seed...), else the points
    would mix different settings: that is an error.
    """
    series: dict[tuple, dict[float, list[Run]]] = {}
    for run in runs:
        if run.params is None:
            raise ScalevecError(run.name, "no parameter count N for the scaling fit.",
                                "keep the trainer's describe.json (total_params) in the run directory, "
                                "or log a `params` value in the metrics.")
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
                                    f"its runs differ in more than the seed: {', '.join(differing_keys(configs))}.",
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
            fit = ["", "", "", ""] if s.fit is None else [repr(s.fit.E), repr(s.fit.A), repr(s.fit.alpha),
                                                          repr(s.fit.rmse)]
            w.writerow([s.label, len(s.sizes), int(s.counts.sum()), *fit])

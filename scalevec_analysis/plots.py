"""The plots: loss curves of groups, scaling fits, compute efficiency and the diagnostics of runs
side by side. matplotlib is imported only when a plot is drawn, so that the rest of the package
works without it."""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from scalevec_analysis.diagnostic_series import PANELS, panel_series
from scalevec_analysis.efficiency import EfficiencyRow, Series
from scalevec_analysis.envelope import ABOVE, AT_MOST, EXACT
from scalevec_analysis.grouping import Group, ema, mean_curve, metric_curve
from scalevec_analysis.runs import Run
from scalevec_analysis.scaling import PowerLawFit, ScalingSeries
from scalevec_train.infra.errors import ScalevecError


def _figure(path: Path, **kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ScalevecError(str(path), "plots need matplotlib, which is not installed.",
                            'pip install -e ".[analysis]".') from None
    return Figure(**kwargs)


def plot_curves(groups: Sequence[Group], path: Path, ema_beta: float | None = None,
                logx: bool = False, logy: bool = False, metric: str = "val_loss") -> None:
    """Training and (when logged) validation loss and bits per byte against tokens, and `metric`
    where it is another (one source's of a data mixture): each group's mean over runs, bold, over
    its single runs, faint. `ema_beta` smooths the training-loss curves only."""
    panels = [("loss", "loss")]
    base, _, source = metric.partition("/")
    named = {"val_loss": "validation loss", "val_bpb": "validation bits per byte"}
    extra = ((metric, f"{named[base]}, {source}"),) if source else ()
    for metric, label in (("val_loss", "validation loss"), ("val_bpb", "validation bits per byte"),
                          *extra):
        if any(metric in rec for g in groups for r in g.runs for rec in r.records):
            panels.append((metric, label))
    fig = _figure(path, figsize=(6.5 * len(panels), 4.8), layout="constrained")
    for ax, (metric, ylabel) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels,
                                    strict=True):
        for i, g in enumerate(groups):
            runs = [r for r in g.runs if any(metric in rec for rec in r.records)]
            if not runs:
                continue
            curves = [metric_curve(r, metric) for r in runs]
            if metric == "loss" and ema_beta:
                curves = [(t, ema(v, ema_beta)) for t, v in curves]
            color = f"C{i % 10}"
            if len(curves) > 1:
                for t, v in curves:
                    ax.plot(t, v, color=color, alpha=0.25, linewidth=0.8)
            t, v = mean_curve(curves, f"group {g.label!r}")
            ax.plot(t, v, color=color, linewidth=1.6, label=f"{g.label} (n={len(curves)})")
        smoothing = f", EMA {ema_beta}" if metric == "loss" and ema_beta else ""
        ax.set_title(f"{'training loss' if metric == 'loss' else ylabel}{smoothing}")
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log" if logx else "linear")
        ax.set_yscale("log" if logy else "linear")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Loss against training tokens (mean over seeds)")
    fig.savefig(path, dpi=120)


def plot_scaling(series: Sequence[ScalingSeries], path: Path, metric: str = "val_loss") -> None:
    fig = _figure(path, figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        ax.scatter(s.sizes, s.losses, color=color, zorder=3,
                   label=s.label if s.fit is None else None)
        if s.fit is not None:
            n = np.geomspace(s.sizes[0] / 1.5, s.sizes[-1] * 1.5, 200)
            ax.plot(n, s.fit(n), color=color, label=f"{s.label}: E={s.fit.E:.3f}, A={s.fit.A:.3g}, "
                                                    f"α={s.fit.alpha:.3f}")
    _log_loss_axes(ax, "parameters N", "Scaling fit L(N) = E + A·N^(-α) per strategy", metric)
    fig.savefig(path, dpi=120)


def _log_loss_axes(ax, xlabel: str, title: str, metric: str) -> None:
    """Terminal loss against a log-scaled size or compute, with a legend of the fits."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    names = {"val_loss": "validation loss", "val_bpb": "validation bits per byte"}
    base, _, source = metric.partition("/")
    ax.set_ylabel(f"terminal {names.get(base, 'loss')}" + (f", {source}" if source else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")


def plot_efficiency(series: Sequence[Series], fits: dict[str, PowerLawFit],
                    rows: Sequence[EfficiencyRow], reference: str, path: Path,
                    metric: str = "val_loss") -> None:
    """Left: terminal loss against training compute, every run (faint), each point's mean and each
    series' fit. Right: the compute multipliers of the strategies' points: from the reference's
    curves (the geometric mean over seeds; a triangle up for a lower bound, down for an upper bound)
    and from the reference's law at the point's loss and at the strategy's law, with their bootstrap
    intervals (one the law never reaches is left out)."""
    fig = _figure(path, figsize=(13, 5), layout="constrained")
    loss_ax, mult_ax = fig.subplots(1, 2)
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        for p in s.points:
            loss_ax.scatter([p.compute] * len(p.losses), p.losses, color=color, alpha=0.3, s=12)
        computes = np.array([p.compute for p in s.points])
        loss_ax.scatter(computes, [p.losses.mean() for p in s.points], color=color, zorder=3)
        grid = np.geomspace(computes[0] / 1.5, computes[-1] * 1.5, 200)
        f = fits[s.label]
        loss_ax.plot(grid, f(grid), color=color,
                     label=f"{s.label}{' (ref)' if s.label == reference else ''}: "
                                                       f"E={f.E:.3f}, A={f.A:.3g}, α={f.alpha:.3f}")
        points = [r for r in rows if r.series == s.label and r.compute is not None]
        for marker, bound, kind in (("o", EXACT, "exact"), ("^", ABOVE, "lower bound"),
                                    ("v", AT_MOST, "upper bound")):
            shown = [r for r in points if r.curves is not None and r.curves.bound == bound]
            if shown:
                mult_ax.scatter([r.compute for r in shown], [r.curves.value for r in shown],
                                color=color, marker=marker, zorder=3,
                                label=f"{s.label}, from ref's curves ({kind})")
        for offset, kind, marker, label in ((0.93, "law_at_loss", "s", "ref's law at the loss"),
                                            (1.07, "law_at_fit", "D",
                                             "ref's law at the strategy's law")):
            shown = [r for r in points if np.isfinite(getattr(r, kind).high)]
            if not shown:
                continue
            value = np.array([getattr(r, kind).value for r in shown])
            errors = np.array([[v - getattr(r, kind).low, getattr(r, kind).high - v]
                               for r, v in zip(shown, value, strict=True)]).T
            mult_ax.errorbar([r.compute * offset for r in shown], value, yerr=errors, color=color,
                             marker=marker, markerfacecolor="none", linestyle="none", capsize=3,
                             label=f"{s.label}, {label}")
    _log_loss_axes(loss_ax, "training compute C (FLOPs)",
                   "Fits L(C) = E + A·C^(-α), E ≥ 0, per strategy", metric)
    mult_ax.axhline(1.0, color="black", linewidth=0.8)
    mult_ax.set_xscale("log")
    mult_ax.set_xlabel("training compute C (FLOPs)")
    mult_ax.set_ylabel(f"compute multiplier against {reference}")
    mult_ax.set_title("Compute multiplier (the law's: 95% bootstrap intervals over seeds)")
    mult_ax.grid(alpha=0.3, which="both")
    if mult_ax.get_legend_handles_labels()[0]:
        mult_ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)


def plot_diagnostics(runs: Sequence[Run], labels: Sequence[str], path: Path) -> None:
    """The training loss and the diag/* metrics over training tokens
    (scalevec_analysis.diagnostic_series.PANELS: a row per statistic), a column per run with the
    rows' y axes shared, so that runs (baseline against unified, bf16 against FP8) compare side by
    side. A line per layer (viridis, first to last; final in black), per kind of map (the mean over
    the layers), or the loss (black)."""
    fig = _figure(path, figsize=(6.5 * len(runs), 3.2 * len(PANELS)), layout="constrained")
    axes = fig.subplots(len(PANELS), len(runs), squeeze=False, sharey="row")
    # one color per kind of map in every panel and column
    maps = sorted({name for run in runs for panel in PANELS if panel.per == "map"
                   for name in panel_series(run, panel)})
    for col, (run, label) in enumerate(zip(runs, labels, strict=True)):
        for ax, panel in zip(axes[:, col], PANELS, strict=True):
            series = panel_series(run, panel)
            layers = [name for name in series if name.startswith("layer ")]
            for name, (tokens, values) in series.items():
                if panel.per == "run":
                    color = "black"
                elif panel.per == "layer":
                    color = ("black" if name == "final"
                             else _viridis(layers.index(name), len(layers)))
                else:
                    color = _map_color(maps.index(name), len(maps))
                ax.plot(tokens, values, color=color, linewidth=1.2, label=name)
            ax.set_title(f"{label}: {panel.title}", fontsize="small")
            ax.set_xlabel("tokens")
            ax.set_yscale("log" if panel.logy else "linear")
            ax.grid(alpha=0.3)
            if series and (panel.per == "map" or len(series) <= 12):
                ax.legend(fontsize="x-small", ncol=2)
    fig.suptitle("Diagnostics: the scale vectors' mechanism over training")
    fig.savefig(path, dpi=100)


def _viridis(i: int, n: int) -> tuple:
    from matplotlib import colormaps

    return colormaps["viridis"](i / max(n - 1, 1))


def _map_color(i: int, n: int):
    from matplotlib import colormaps

    return f"C{i}" if n <= 10 else colormaps["tab20"](i % 20)

"""Output directories: a comparison of groups (curves.png, summary.md, summary.csv), a scaling fit
(scaling.png, scaling.md, scaling.csv), compute efficiency (efficiency.png, efficiency.md,
efficiency.csv) or the diagnostics of runs side by side (diagnostics.png)."""

from collections.abc import Sequence
from pathlib import Path

from scalevec_analysis.diagnostic_series import check_diagnostics
from scalevec_analysis.efficiency import (
    compute_efficiency,
    efficiency_markdown,
    efficiency_series,
    find_reference,
    fit_residuals,
    write_efficiency_csv,
)
from scalevec_analysis.grouping import (
    find_group,
    group_runs,
    summarize,
    summary_markdown,
    write_summary_csv,
)
from scalevec_analysis.plots import plot_curves, plot_diagnostics, plot_efficiency, plot_scaling
from scalevec_analysis.runs import Run
from scalevec_analysis.scaling import scaling_markdown, scaling_series, write_scaling_csv
from scalevec_analysis.trend import (
    exponent_difference,
    fit_trend,
    head_shares,
    trend_markdown,
    trend_points,
)


def write_comparison(runs: Sequence[Run], reference: str, out_dir: str | Path,
                     metric: str = "val_loss", last_k: int = 1, ema_beta: float | None = None,
                     logx: bool = False, logy: bool = False, ignore: Sequence[str] = ()) -> str:
    """Group `runs`, write out_dir/curves.png, summary.md and summary.csv; return the
    markdown table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, ignore)
    ref = find_group(groups, reference)
    rows = summarize(groups, ref, metric, last_k)
    table = summary_markdown(rows, metric)
    (out / "summary.md").write_text(table)
    write_summary_csv(rows, out / "summary.csv")
    plot_curves(groups, out / "curves.png", ema_beta, logx, logy, metric)
    return table


def write_scaling(runs: Sequence[Run], out_dir: str | Path, metric: str = "val_loss",
                  last_k: int = 1, series_keys: Sequence[str] = ("scale",),
                  ignore: Sequence[str] = ()) -> str:
    """Fit each series, write out_dir/scaling.png, scaling.md and scaling.csv; return
    the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = scaling_series(runs, metric, last_k, series_keys, ignore)
    table = scaling_markdown(series)
    (out / "scaling.md").write_text(table)
    write_scaling_csv(series, out / "scaling.csv")
    plot_scaling(series, out / "scaling.png", metric)
    return table


def write_efficiency(runs: Sequence[Run], reference: str, out_dir: str | Path,
                     metric: str = "val_loss", last_k: int = 1,
                     series_keys: Sequence[str] = ("scale",), ignore: Sequence[str] = (),
                     bootstrap: int = 1000,
                     extrapolate: Sequence[tuple[str, float, float]] = ()) -> str:
    """Compute multipliers of every strategy against `reference` (scalevec_analysis.efficiency);
    write out_dir/efficiency.png, efficiency.md and efficiency.csv, and each strategy's trend over
    the ladder (scalevec_analysis.trend) to out_dir/trend.md, with the pooled trend carried to each
    (label, compute, budget) of `extrapolate`; return the efficiency markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = efficiency_series(runs, metric, last_k, series_keys, ignore)
    ref = find_reference(series, reference)
    rows, fits = compute_efficiency(series, ref, bootstrap)
    residuals = fit_residuals(series, fits)
    table = efficiency_markdown(rows, fits, residuals, ref.label, bootstrap)
    (out / "efficiency.md").write_text(table)
    write_efficiency_csv(rows, residuals, ref.label, out / "efficiency.csv")
    plot_efficiency(series, fits, rows, ref.label, out / "efficiency.png", metric)
    shares = head_shares(runs)
    trends = []
    for s in series:
        if s is ref:
            continue
        points = trend_points(rows, s, shares)
        budgets = sorted({p.budget for p in points})
        blocks = [p for p in points if p.head_share < 0.5]
        fits_of = {"pooled": fit_trend(points, budgets, bootstrap),
                   **{f"{b:g} tokens per parameter": fit_trend(points, (b,), bootstrap)
                      for b in budgets},
                   "pooled, rungs whose head is under half the compute":
                       fit_trend(blocks, budgets, bootstrap)}
        trends.append(f"## {s.label} against {ref.label}\n\n" + trend_markdown(
            points, fits_of, exponent_difference(s, ref, bootstrap), extrapolate))
    (out / "trend.md").write_text("\n".join(trends))
    return table


def write_diagnostics(runs: Sequence[Run], out_dir: str | Path, ignore: Sequence[str] = ()) -> str:
    """out_dir/diagnostics.png: the diag/* metrics of `runs`, a column each, labelled by what sets
    their configs apart (as groups are); returns a line naming the file."""
    check_diagnostics(list(runs))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, ignore)
    label_of = {id(run): group.label for group in groups for run in group.runs}
    # runs of one config (seeds) keep their directory's name apart
    labels = [label_of[id(run)] if len(groups) == len(runs)
              else f"{label_of[id(run)]} ({Path(run.name).name})" for run in runs]
    plot_diagnostics(runs, labels, out / "diagnostics.png")
    return f"wrote {out / 'diagnostics.png'} ({', '.join(labels)})\n"

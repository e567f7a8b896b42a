"""Per-seed paired differences of run groups against a baseline group, and the share of a unified
arm's gap each closes (scripts/run_study.sh adamw_l3;
docs/results/why-unified-loses-under-adamw.md).

    python scripts/arm_report.py OUT.md --baseline PREFIX --unified PREFIX PREFIX...
        [--over-training GAP.md]

A PREFIX is a run directory without its `-s<seed>` ending; its runs are the directories
PREFIX-s<seed>.
For every group (the baseline and unified groups included), one row: its terminal val_loss per seed
(the last logged value), minus the baseline's of the same seed, the mean of those differences, the
seeds on which it is lower than the baseline, and the share of the unified group's gap it closes on
each seed: (unified - group) / (unified - baseline), 1 meaning as low as the baseline and 0 as high
as unified (a group counts as closing the gap where the share is at least 0.5 on every seed). Beside
them, from the last diagnostics record (train.diagnostics_every), the RMS of the final norm's scale
(which sets the tied head's logits) averaged over seeds. A group lacking a seed the baseline has is
an error: no seed is dropped silently. --over-training writes when the gap opens: at every
evaluation of the runs, unified's val_loss minus the baseline's on each seed, and their mean; then
at every diagnostics record, the final norm's scale and its update ratio (the step's change over the
scale, RMS) of both groups, averaged over seeds.
"""

import argparse
import re
import statistics
from functools import cache
from pathlib import Path

from scalevec_analysis import load_run_dir, metric_curve
from scalevec_train.training.logger import read_records

FINAL_SCALE = "diag/final_norm.sites.final/scale_rms"
FINAL_UPDATE = "diag/final_norm.sites.final/scale_update_ratio"


def seeds_of(prefix: str) -> dict[int, Path]:
    """{seed: run directory} of the runs PREFIX-s<seed>."""
    base = Path(prefix)
    found = {}
    for d in base.parent.glob(f"{base.name}-s*"):
        m = re.fullmatch(re.escape(base.name) + r"-s(\d+)", d.name)
        if m and d.is_dir():
            found[int(m.group(1))] = d
    return found


def terminal(run_dir: Path) -> float:
    return float(metric_curve(load_run_dir(str(run_dir)), "val_loss")[1][-1])


@cache  # a run's records serve its row, its gap over training and its diagnostics: read once
def records(run_dir: Path) -> list[dict]:
    return read_records(run_dir / "metrics.jsonl")


def final_scale(run_dir: Path) -> float | None:
    values = [r[FINAL_SCALE] for r in records(run_dir) if FINAL_SCALE in r]
    return values[-1] if values else None


def over_training(base_runs: dict[int, Path], uni_runs: dict[int, Path]) -> str:
    """The unified group's val_loss minus the baseline's at each evaluation step, per seed and
    mean."""
    seeds = sorted(base_runs)
    curves = {}
    for s in seeds:
        base, uni = ({r["step"]: r["val_loss"] for r in records(d) if "val_loss" in r}
                     for d in (base_runs[s], uni_runs[s]))
        if base.keys() != uni.keys():
            raise SystemExit(f"error: seed {s}'s baseline and unified runs were evaluated at "
                             f"different steps ({sorted(base)} and {sorted(uni)}). Fix: compare "
                             "runs of one eval_every and length.")
        curves[s] = {step: uni[step] - base[step] for step in base}
    steps = sorted(curves[seeds[0]])
    if any(sorted(c) != steps for c in curves.values()):
        raise SystemExit("error: the seeds' runs were evaluated at different steps. Fix: compare "
                         "runs of one eval_every and length.")
    lines = ["| step | " + " | ".join(f"s{s}" for s in seeds) + " | mean |",
             "|---:|" + "---:|" * (len(seeds) + 1)]
    for step in steps:
        gaps = [curves[s][step] for s in seeds]
        lines.append(f"| {step} | " + " | ".join(f"{g:+.4f}" for g in gaps)
                     + f" | {statistics.fmean(gaps):+.4f} |")
    diags = [final_norm_over_training(runs[s]) for runs in (base_runs, uni_runs) for s in seeds]
    common = sorted(set.intersection(*(set(d) for d in diags)))
    if common:
        lines += ["", "| step | final norm scale, baseline | unified | update ratio, "
                      "baseline | unified |",
                  "|---:|---:|---:|---:|---:|"]
        for step in common:
            means = [statistics.fmean(d[step][i] for d in group) for i in (0, 1)
                     for group in (diags[:len(seeds)], diags[len(seeds):])]
            lines.append(f"| {step} | {means[0]:.3f} | {means[1]:.3f} | {means[2]:.1e} | "
                         f"{means[3]:.1e} |")
    return "\n".join(lines) + "\n"


def final_norm_over_training(run_dir: Path) -> dict[int, tuple[float, float]]:
    """{step: (final norm's scale RMS, its update ratio)} at each diagnostics record (a resumed
    run's repeated steps: the last record)."""
    return {r["step"]: (r[FINAL_SCALE], r[FINAL_UPDATE]) for r in records(run_dir)
            if FINAL_SCALE in r and FINAL_UPDATE in r}


def row(name: str, runs: dict[int, Path], base: dict[int, float], uni: dict[int, float]) -> str:
    missing = sorted(set(base) - set(runs))
    if missing:
        raise SystemExit(f"error: {name} lacks seed(s) {missing} that the baseline has. "
                         "Fix: run them.")
    seeds = sorted(base)
    loss = {s: terminal(runs[s]) for s in seeds}
    delta = {s: loss[s] - base[s] for s in seeds}
    # + 0.0: a share of nothing over a negative gap is -0.0, printed "-0.00"
    closed = {s: (uni[s] - loss[s]) / (uni[s] - base[s]) + 0.0 if uni[s] != base[s]
              else float("nan") for s in seeds}
    scales = [v for v in (final_scale(runs[s]) for s in seeds) if v is not None]
    cells = [name, ", ".join(f"s{s} {loss[s]:.4f}" for s in seeds),
             ", ".join(f"s{s} {delta[s]:+.4f}" for s in seeds),
             f"{statistics.fmean(delta.values()):+.4f}",
             f"{sum(d < 0 for d in delta.values())}/{len(seeds)}",
             ", ".join(f"s{s} {closed[s]:.2f}" for s in seeds),
             "yes" if all(c >= 0.5 for c in closed.values()) else "no",
             f"{statistics.fmean(scales):.3f}" if len(scales) == len(seeds) else "-"]
    return "| " + " | ".join(cells) + " |"


def report(out: Path, baseline: str, unified: str, prefixes: list[str],
           gap_out: Path | None = None) -> str:
    base_runs = seeds_of(baseline)
    if not base_runs:
        raise SystemExit(f"error: no runs {baseline}-s<seed>. Fix: run the baseline first.")
    base = {s: terminal(d) for s, d in base_runs.items()}
    uni_runs = seeds_of(unified)
    missing = sorted(set(base) - set(uni_runs))
    if missing:
        raise SystemExit(f"error: {unified} lacks seed(s) {missing} that the baseline has. "
                         "Fix: run them.")
    uni = {s: terminal(uni_runs[s]) for s in base}
    lines = ["| runs | terminal val_loss | minus baseline | mean | seeds lower | share of "
             "unified's gap closed | closes half on every seed | final norm scale (RMS) |",
             "|---|---|---|---:|---:|---|---|---:|"]
    for prefix in dict.fromkeys([baseline, unified, *prefixes]):
        lines.append(row(Path(prefix).name, seeds_of(prefix), base, uni))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    if gap_out is not None:
        gap_out.parent.mkdir(parents=True, exist_ok=True)
        gap_out.write_text(over_training(base_runs, uni_runs))
    return out.read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--baseline", required=True, help="the baseline group's prefix")
    p.add_argument("--unified", required=True,
                   help="the unified group whose gap the others are measured against")
    p.add_argument("prefixes", nargs="*", help="the other groups, in the order of the table")
    p.add_argument("--over-training", type=Path, metavar="GAP.md",
                   help="also write unified's gap to the baseline at every evaluation, per seed")
    args = p.parse_intermixed_args()
    print(report(args.out, args.baseline, args.unified, args.prefixes, args.over_training), end="")


if __name__ == "__main__":
    main()

"""The ladder study's own tables (scripts/run_study.sh ladder;
docs/results/compute-multiplier-ladder.md).

  ladder_report.py lr OUT.md RUN_DIR...     the learning-rate grid: every arm's terminal val_loss at
                                            each peak LR; prints "scale optim lr" per arm, its best
                                            LR (lowest terminal val_loss; the lower LR on a tie)
  ladder_report.py table OUT.md RUN_DIR...  per rung, budget and optimizer: baseline and unified
                                            terminal val_loss and val_bpb (mean and sample std over
                                            seeds), and unified minus baseline per seed (paired by
                                            seed); and the embedded task's accuracy where a run
                                            directory holds next_line.txt
                                            (`python -m scalevec_train.evaluate RUN tasks=embedded`
                                            on its final checkpoint)

Terminal: the last logged value (the trainer evaluates at the final step). Budgets are tokens per
non-embedding parameter (train.tokens_per_param).
"""

import statistics
import sys
from collections import defaultdict
from pathlib import Path

from scalevec_analysis import load_run_dir, metric_curve

TASK = "task/next_line/acc"
TASK_FILE = "next_line.txt"


def terminal(run, metric: str) -> float:
    if metric == TASK:
        return _task_scores(run.name)[TASK]
    return float(metric_curve(run, metric)[1][-1])


def _task_scores(run_dir: str) -> dict[str, float]:
    """The "name value" lines the evaluate CLI printed for the run's final checkpoint."""
    lines = (Path(run_dir) / TASK_FILE).read_text().splitlines()
    return {name: float(value)
            for name, value in (line.split() for line in lines if line.count(" ") == 1)}


def lr_grid(out: Path, runs) -> str:
    by_arm = defaultdict(dict)  # (scale, optim) -> {lr: val_loss}
    for run in runs:
        c = run.config
        by_arm[c["scale.name"], c["optim.name"]][c["optim.lr"]] = terminal(run, "val_loss")
    lrs = sorted({lr for grid in by_arm.values() for lr in grid})
    lines = ["| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best |",
             "|---|" + "---:|" * (len(lrs) + 1)]
    picks = []
    for (scale, optim), grid in sorted(by_arm.items()):
        best = min(sorted(grid), key=lambda lr: grid[lr])
        cells = [f"**{grid[lr]:.4f}**" if lr == best else (f"{grid[lr]:.4f}" if lr in grid else "")
                 for lr in lrs]
        lines.append(f"| {scale} {optim} | " + " | ".join(cells) + f" | {best:g} |")
        picks.append(f"{scale} {optim} {best}")
    out.write_text("\n".join(lines) + "\n")
    return "\n".join(picks) + "\n"


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.4f} ± {std:.4f}"


def table(out: Path, runs) -> str:
    cells = defaultdict(dict)  # (optim, rung size, model, tpp) -> {scale: {seed: run}}
    for run in runs:
        c = run.config
        key = (c["optim.name"], c["model.dim"], c["model.name"], c["train.tokens_per_param"])
        cells[key].setdefault(c["scale.name"], {})[c["seed"]] = run
    lines = ["| optimizer | rung | tokens/param | metric | baseline | unified | unified - baseline "
             "per seed | mean Δ | seeds better |", "|---|---|---:|---|---:|---:|---|---:|---:|"]
    for (optim, _, model, tpp), arms in sorted(cells.items()):
        base, uni = arms.get("baseline", {}), arms.get("unified", {})
        seeds = sorted(set(base) & set(uni))
        scored = all((Path(r.name) / TASK_FILE).is_file()
                     for arm in (base, uni) for r in arm.values())
        for metric in ("val_loss", "val_bpb", TASK) if scored else ("val_loss", "val_bpb"):
            b = [terminal(base[s], metric) for s in sorted(base)]
            u = [terminal(uni[s], metric) for s in sorted(uni)]
            deltas = [terminal(uni[s], metric) - terminal(base[s], metric) for s in seeds]
            per_seed = ", ".join(f"s{s} {d:+.4f}" for s, d in zip(seeds, deltas, strict=True))
            lower = f"{sum(d < 0 if metric != TASK else d > 0 for d in deltas)}/{len(deltas)}"
            mean = f"{statistics.fmean(deltas):+.4f}" if deltas else ""
            lines.append(f"| {optim} | {model} | {tpp:g} | {metric} | {_mean_std(b) if b else ''} "
                         f"| {_mean_std(u) if u else ''} | {per_seed} | {mean} | {lower} |")
    out.write_text("\n".join(lines) + "\n")
    return out.read_text()


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("lr", "table"):
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [load_run_dir(d) for d in argv[2:]]
    print((lr_grid if argv[0] == "lr" else table)(out, runs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

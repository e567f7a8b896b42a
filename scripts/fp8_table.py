"""The FP8 study's tables (docs/results/what-fp8-does-to-scale-vectors.md), read from its kept runs
(docs/results/fp8/runs/, `bash scripts/run_study.sh fp8`): per arm, precision and seed the
terminal val_loss, its FP8 penalty (minus the same arm and seed in bf16) and w_down's input
outliers; then each arm's penalty against the baseline's, seed by seed.

The outlier columns are w_down's input, the largest over the layers at each diagnostics step,
averaged over the steps of the run's second half (the tails grow during training); "flushed" is the
share of it the FP8 cast rounds to zero.

    python scripts/fp8_table.py [RUNS] > docs/results/fp8/per_seed.md
"""

import argparse
import json
import re
import statistics
from pathlib import Path

# run-name part after "dense-l3-" -> the arm as the tables name it
ARMS = {
    "baseline-adamw-lr0.003-scale_lr0.01": "baseline",
    "unified-adamw-lr0.003-scale_lr0.01": "unified",
    "unified-adamw-lr0.003-scale_lr0.01-heterogeneity.shared": "unified with one site per norm",
    "unified-adamw-lr0.003-scale_lr0.01-reparam.plain": "unified with plain sites",
    "unified-adamw-lr0.003-scale_lr0.01-targets.q.k.v":
        "unified without gate/up sites (targets q, k, v)",
}
PRECISIONS = ("bf16", "tensorwise", "rowwise")
NAME = re.compile(r"dense-l3-(?P<arm>.+?)(?:-model\.fp8\.(?P<fp8>\w+))?-s(?P<seed>\d+)$")


def read_run(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows)
    late = [r for r in rows if r["step"] > last / 2
            and any(k.endswith("ffn.w_down/in_kurtosis") for k in r)]

    def outlier(key: str) -> float | None:
        per_step = [max(v for k, v in r.items() if k.startswith("diag/layer")
                        and k.endswith(f"ffn.w_down/{key}")) for r in late
                    if any(k.endswith(f"ffn.w_down/{key}") for k in r)]
        return statistics.mean(per_step) if per_step else None

    return {"val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
            "kurtosis": outlier("in_kurtosis"), "max_rms": outlier("in_max_rms"),
            "flushed": outlier("fp8_underflow")}


def read_runs(root: Path) -> dict[tuple[str, str, int], dict]:
    runs = {}
    for run in sorted(root.iterdir()):
        match = NAME.match(run.name)
        if match is None or match["arm"] not in ARMS or not (run / "metrics.jsonl").exists():
            continue
        runs[ARMS[match["arm"]], match["fp8"] or "bf16", int(match["seed"])] = read_run(run)
    return runs


def penalty(runs: dict, arm: str, precision: str, seed: int) -> float | None:
    fp8, bf16 = runs.get((arm, precision, seed)), runs.get((arm, "bf16", seed))
    return None if fp8 is None or bf16 is None else fp8["val_loss"] - bf16["val_loss"]


def per_seed_table(runs: dict) -> list[str]:
    lines = ["| arm | precision | seed | terminal val_loss | FP8 minus bf16 "
             "| w_down input kurtosis | max/RMS | FP8 flushed to 0 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS.values():
        for precision in PRECISIONS:
            for seed in sorted({s for a, p, s in runs if a == arm and p == precision}):
                r = runs[arm, precision, seed]
                gap = None if precision == "bf16" else penalty(runs, arm, precision, seed)
                flushed = "" if precision == "bf16" or r["flushed"] is None \
                    else f"{100 * r['flushed']:.2f}%"
                lines.append(f"| {arm} | {precision} | {seed} | {r['val_loss']:.4f} | "
                             f"{'' if gap is None else f'{gap:+.4f}'} | {r['kurtosis']:.0f} | "
                             f"{r['max_rms']:.1f} | {flushed} |")
    return lines


def against_baseline(runs: dict) -> list[str]:
    """Each arm's FP8 penalty minus the baseline's, paired by seed (negative: FP8 costs the arm
    less than it costs the baseline)."""
    seeds = sorted({s for _, _, s in runs})
    lines = ["| arm | precision | " + " | ".join(f"seed {s}" for s in seeds)
             + " | mean | penalty, mean over seeds |",
             "|---|---|" + "---:|" * (len(seeds) + 2)]
    for arm in ARMS.values():
        for precision in PRECISIONS[1:]:
            own = [penalty(runs, arm, precision, s) for s in seeds]
            base = [penalty(runs, "baseline", precision, s) for s in seeds]
            diffs = [None if a is None or b is None else a - b for a, b in zip(own, base)]
            known = [d for d in diffs if d is not None]
            if arm == "baseline":
                cells, mean = ["" for _ in seeds], ""
            else:
                cells = ["" if d is None else f"{d:+.4f}" for d in diffs]
                mean = f"{statistics.mean(known):+.4f}" if known else ""
            gaps = [g for g in own if g is not None]
            lines.append(f"| {arm} | {precision} | " + " | ".join(cells) + f" | {mean} | "
                         + (f"{statistics.mean(gaps):+.4f}" if gaps else "") + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="?", type=Path,
                        default=Path(__file__).resolve().parents[1] / "docs/results/fp8/runs")
    args = parser.parse_args(argv)
    runs = read_runs(args.runs)
    if not runs:
        parser.error(f"no FP8 study runs in {args.runs}: run `bash scripts/run_study.sh fp8` first")
    print("\n".join([*per_seed_table(runs), "", *against_baseline(runs)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

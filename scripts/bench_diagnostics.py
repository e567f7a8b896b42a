"""What train.diagnostics_every costs: the wall time of whole training steps (the step and every
callback's hooks, the diagnostics' included) of the same run with diagnostics off and on every step,
side by side. Both log every step, so they differ only in the diagnostics.

    python scripts/bench_diagnostics.py                                  # dense-tiny on the CPU
    python scripts/bench_diagnostics.py --steps 20 -- scale=unified model=moe-tiny

Arguments after `--` are Hydra overrides for both runs. Prints the median step time of each (the
first --warmup steps left out) and their ratio.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from scalevec_train import train
from scalevec_train.config import compose_config
from scalevec_train.training.trainer import Callback, Trainer


class StepClock(Callback):
    """Wall time from a step's first hook (`first`, a clock that runs before every other callback)
    to its last (the clock that runs after every other)."""

    def __init__(self, times: list[float], first: bool):
        self.times, self.first = times, first
        self.priority = -2 if first else 2  # the callbacks' priorities are -1 (the profiler) to 1

    def on_step_start(self, trainer: Trainer) -> None:
        if self.first:
            self.times.append(-time.perf_counter())

    def on_step_done(self, trainer: Trainer) -> None:
        if not self.first:
            self.times[-1] += time.perf_counter()


def step_times(overrides: list[str]) -> list[float]:
    times: list[float] = []
    build = train.build

    def clocked(cfg):
        built = build(cfg)
        built.trainer.add_callbacks(StepClock(times, first=True), StepClock(times, first=False))
        return built

    train.build = clocked
    try:
        train.run(compose_config(overrides, 1))
    finally:
        train.build = build
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for both runs (after --)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="scalevec_bench_diag_") as tmp:
        for name, every in (("off", 0), ("every step", 1)):
            overrides = ["model=dense-tiny", "device=cpu", "logger.progress_bar=false",
                         "train.log_every=1", "train.eval_every=0",
                         f"train.steps={args.warmup + args.steps}", "schedule.warmup_steps=1",
                         f"train.diagnostics_every={every}",
                         f"run_dir={Path(tmp) / name.replace(' ', '_')}", *args.overrides]
            rows.append((name, statistics.median(step_times(overrides)[args.warmup:]) * 1e3))
    print("| diagnostics | median step ms | ratio |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()

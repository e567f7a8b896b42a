"""Learning-rate grids per ladder rung, run as a queue (scripts/run_study.sh lr_ladder; docs/results.md).

  lr_grid.py next ROOT PID PART...  claims the next run to train (longest first) for the worker PID and
                                    prints its `rung run_dir override...`; prints nothing and exits 3 while the
                                    runs still to come wait on runs in progress, exits 4 when every run
                                    of the parts is done
  lr_grid.py done ROOT RUN_DIR RC   releases the claim on a run that ended with exit status RC: 3 (the
                                    trainer's "diverged") keeps it as failed; another error stops the
                                    worker (exit 1); a signal leaves it to be trained again
  lr_grid.py report ROOT OUT_DIR PART...   the grids, the picks, and the run directories of the final
                                    seeds (OUT_DIR/<part>_grid.md, OUT_DIR/<part>_final.txt)

A part is an optimizer with its grid (PARTS below); per rung and strategy (an arm) it goes through:
  1. grid: the peak LR (optim.lr: every parameter but the scale sites, which have scale_lr when set) on
     the 1-3-10 sequence, the part's seeds, each run a WSD trunk to 10 tokens per parameter;
  2. widen: while the best LR (lowest mean terminal val_loss over the seeds) is at the grid's edge, the
     next LR beyond it;
  3. tie-break: where the two best LRs are closer than either one's spread over the seeds, the
     tie-break seed at both, and the better by the mean over all seeds;
  4. sites: at the best LR, the scale sites' LR one grid step down and up (same seeds); the pick is the
     best of the three;
  5. final: the pick with the final seeds, trunks and their WSD branches to 2.5 and 5 tokens per parameter.
A run is done when its last checkpoint is complete (checkpoints/step_<train.steps>/COMPLETE). A run that
diverged (non-finite steps past train.max_bad_steps) counts as the worst point of its grid and is
written as failed; its log says why. Claims (ROOT_logs/<name>.claim) hold what a worker trains, so two
workers never take one run; `next` clears the claims of workers that are gone.
"""

import fcntl
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

SEQUENCE = [float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 3)]  # the 1-3-10 grid of LRs, 1e-5 .. 3
RUNGS = ("dense-l3", "dense-l2", "dense-l1")
SCALES = ("baseline", "unified")
BRANCHES = (2.5, 5.0)
FAILED = float("inf")


@dataclass(frozen=True)
class Part:
    optim: str
    lrs: tuple[float, ...]  # the first grid
    seeds: tuple[int, ...]
    tiebreak: int | None = None  # the seed added where the two best LRs are within the seeds' spread
    scale_lr: float | None = None  # the sites' LR during the grid; sites stage one step either side
    final: tuple[int, ...] = ()  # seeds at the pick, with WSD branches
    overrides: tuple[str, ...] = ()
    tag: str = ""  # in every run's name, for the overrides
    rungs: tuple[str, ...] = RUNGS
    scales: tuple[str, ...] = SCALES


LRS = (0.001, 0.003, 0.01, 0.03)
PARTS = {
    # issue 47, item 1: every rung at each arm's own best LR, the sites at optim.scale_lr=0.01
    "adamw": Part("adamw", LRS, seeds=(0, 1), tiebreak=2, scale_lr=0.01, final=(0, 1, 2)),
    # the Muon ladder's grid (its settings) on one seed per rung: a check of its dense-l2 picks
    "muon": Part("muon", LRS, seeds=(0,)),
}


def fmt(x: float) -> str:
    return f"{x:g}"


def step(lr: float, k: int) -> float:
    i = min(range(len(SEQUENCE)), key=lambda j: abs(SEQUENCE[j] / lr - 1))
    return SEQUENCE[max(0, min(len(SEQUENCE) - 1, i + k))]


@dataclass(frozen=True)
class Run:
    rung: str
    scale: str
    part: Part
    lr: float
    scale_lr: float | None
    seed: int
    tpp: float = 10.0

    @property
    def name(self) -> str:
        sites = f"-scale_lr{fmt(self.scale_lr)}" if self.scale_lr is not None else ""
        tag = f"-{self.part.tag}" if self.part.tag else ""
        return (f"{self.rung}-{self.scale}-{self.part.optim}{tag}-lr{fmt(self.lr)}{sites}"
                f"-tpp{self.tpp:g}-s{self.seed}")

    def overrides(self, root: Path) -> list[str]:
        args = [f"scale={self.scale}", f"optim={self.part.optim}", f"optim.lr={fmt(self.lr)}", f"seed={self.seed}",
                *self.part.overrides]
        if self.scale_lr is not None:
            args.append(f"optim.scale_lr={fmt(self.scale_lr)}")
        if self.tpp != 10.0:
            trunk = Run(self.rung, self.scale, self.part, self.lr, self.scale_lr, self.seed)
            args += [f"train.tokens_per_param={self.tpp:g}", f"branch_from={root / trunk.name}"]
        return args + [f"run_dir={root / self.name}"]


class State:
    """What ROOT holds: each run done (its terminal val_loss), failed, or not yet."""

    def __init__(self, root: Path):
        self.root, self.logs = root, Path(f"{root}_logs")
        self.done = {}  # run name -> its terminal val_loss, read once

    def loss(self, run: Run) -> float | None:
        if run.name not in self.done:
            loss = self._read(run)
            if loss is None:
                return None
            self.done[run.name] = loss
        return self.done[run.name]

    def _read(self, run: Run) -> float | None:
        if (self.logs / f"{run.name}.failed").is_file():
            return FAILED
        d = self.root / run.name
        if not (d / "config.yaml").is_file():
            return None
        steps = OmegaConf.load(d / "config.yaml").train.steps
        if not (d / "checkpoints" / f"step_{steps:06d}" / "COMPLETE").is_file():
            return None
        # the trainer evaluates at the last step: the newest record with val_loss
        last = next((r["val_loss"] for r in map(json.loads, reversed((d / "metrics.jsonl").read_text().splitlines()))
                     if "val_loss" in r), None)
        return FAILED if last is None or last != last else float(last)


class Arm:
    """One rung and strategy of a part: its stages, the runs each needs, and what they found."""

    def __init__(self, part: Part, rung: str, scale: str, state: State):
        self.part, self.rung, self.scale, self.state = part, rung, scale, state

    def run(self, lr, seed, scale_lr="grid", tpp=10.0) -> Run:
        return Run(self.rung, self.scale, self.part, lr, self.part.scale_lr if scale_lr == "grid" else scale_lr,
                   seed, tpp)

    def losses(self, runs):
        return [self.state.loss(r) for r in runs]

    def mean(self, lr, seeds, scale_lr="grid"):
        values = self.losses([self.run(lr, s, scale_lr) for s in seeds])
        return None if None in values else statistics.fmean(values)

    def plan(self):
        """(runs still needed, None) or ([], the pick (lr, scale_lr, seeds)) when the grid is decided."""
        p = self.part
        lrs = sorted(p.lrs)
        while True:  # 1, 2: the grid, widened while its best is at an edge
            runs = [self.run(lr, s) for lr in lrs for s in p.seeds]
            pending = [r for r in runs if self.state.loss(r) is None]
            if pending:
                return pending, None
            means = {lr: self.mean(lr, p.seeds) for lr in lrs}
            best = min(lrs, key=lambda lr: means[lr])
            if means[best] == FAILED:
                raise SystemExit(f"error: every LR of {self.rung} {self.scale} {p.optim} failed; their logs: "
                                 f"{self.state.logs}/")
            edge = -1 if best == lrs[0] else 1 if best == lrs[-1] else 0
            if edge == 0 or step(best, edge) == best:
                break
            lrs.append(step(best, edge))
            lrs.sort()
        seeds = p.seeds
        if p.tiebreak is not None:  # 3
            first, second = sorted(lrs, key=lambda lr: means[lr])[:2]
            spread = max(_range(self.losses([self.run(lr, s) for s in p.seeds])) for lr in (first, second))
            if abs(means[first] - means[second]) < spread:
                seeds = (*p.seeds, p.tiebreak)
                runs = [self.run(lr, s) for lr in (first, second) for s in seeds]
                pending = [r for r in runs if self.state.loss(r) is None]
                if pending:
                    return pending, None
                best = min((first, second), key=lambda lr: self.mean(lr, seeds))
        if p.scale_lr is None:
            return [], (best, None, seeds)
        sites = [step(p.scale_lr, -1), p.scale_lr, step(p.scale_lr, 1)]  # 4
        runs = [self.run(best, s, slr) for slr in sites for s in seeds]
        pending = [r for r in runs if self.state.loss(r) is None]
        if pending:
            return pending, None
        slr = min(sites, key=lambda x: self.mean(best, seeds, x))
        return [], (best, slr, seeds)

    def final_runs(self, pick) -> list[Run]:
        lr, slr, _ = pick
        trunks = [self.run(lr, s, slr) for s in self.part.final]
        return trunks + [self.run(lr, t.seed, slr, tpp) for t in trunks for tpp in BRANCHES]

    def needed(self) -> list[Run]:
        pending, pick = self.plan()
        if pick is None:
            return pending
        out = []
        for r in self.final_runs(pick):
            if self.state.loss(r) is not None:
                continue
            trunk = self.run(r.lr, r.seed, r.scale_lr)
            if r.tpp == 10.0 or self.state.loss(trunk) not in (None, FAILED):
                out.append(r)
        return out


def _range(values):
    return max(values) - min(values)


def arms(parts, state):
    for name in parts:
        if name not in PARTS:
            raise SystemExit(f"error: unknown part '{name}'. Fix: use one of {', '.join(PARTS)}.")
        part = PARTS[name]
        for rung in part.rungs:
            for scale in part.scales:
                yield name, Arm(part, rung, scale, state)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def next_run(root: Path, pid: int, parts: list[str]) -> int:
    state = State(root)
    state.logs.mkdir(parents=True, exist_ok=True)
    with open(state.logs / ".queue.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        claimed = set()
        for claim in state.logs.glob("*.claim"):
            if _alive(int(claim.read_text() or 0)):
                claimed.add(claim.name[: -len(".claim")])
            else:
                claim.unlink()
        needed = [(parts.index(name), -RUNGS.index(arm.rung), r.tpp != 10.0, arm.rung, r)
                  for name, arm in arms(parts, state) for r in arm.needed()]
        needed = [(rung, r) for *_, rung, r in sorted(needed, key=lambda x: x[:3])]
        free = [(rung, r) for rung, r in needed if r.name not in claimed]
        if not free:
            return 3 if needed else 4
        # the parts in their order; then the smallest rung first (its picks, and their branches, come
        # early), trunks before branches
        rung, run = free[0]
        (state.logs / f"{run.name}.claim").write_text(str(pid))
        print(rung, root / run.name, *run.overrides(root))
    return 0


def done(root: Path, run_dir: str, rc: int) -> int:
    logs = Path(f"{root}_logs")
    name = Path(run_dir).name
    (logs / f"{name}.claim").unlink(missing_ok=True)
    if rc == 3:
        (logs / f"{name}.failed").write_text(f"diverged (exit status 3); log: {logs / name}.log\n")
    elif rc != 0 and rc < 128:
        print(f"error: {run_dir} failed with exit status {rc}; its log: {logs / name}.log", file=sys.stderr)
        return 1
    return 0


def _cell(values):
    if FAILED in values:
        return "failed"
    text = f"{statistics.fmean(values):.4f}"
    return text + (" (" + ", ".join(f"{v:.3f}" for v in values) + ")" if len(values) > 1 else "")


def report(root: Path, out: Path, parts: list[str]) -> int:
    state = State(root)
    out.mkdir(parents=True, exist_ok=True)
    for name in parts:
        part = PARTS[name]
        rows, finals, lrs_seen = [], [], set()
        grids = []
        for _, arm in arms([name], state):
            _, pick = arm.plan()
            grid = {}
            for lr in SEQUENCE:
                seeds = [s for s in (*part.seeds, *([part.tiebreak] if part.tiebreak is not None else []))
                         if state.loss(arm.run(lr, s)) is not None]
                if seeds and all(s in seeds for s in part.seeds):
                    grid[lr] = arm.losses([arm.run(lr, s) for s in seeds])
            lrs_seen |= set(grid)
            grids.append((arm, grid, pick))
            if pick is not None:
                finals += [str(root / r.name) for r in arm.final_runs(pick) if state.loss(r) not in (None, FAILED)]
        lrs = sorted(lrs_seen)
        seeds = ", ".join(map(str, part.seeds))
        rows.append(f"Terminal val_loss at 10 tokens per parameter, mean over seeds {seeds} (each seed's in "
                    "brackets; a third seed where the two best were within the seeds' spread); the pick in bold.\n")
        rows.append("| rung | arm | " + " | ".join(f"lr {fmt(lr)}" for lr in lrs) + " | pick |")
        rows.append("|---|---|" + "---:|" * (len(lrs) + 1))
        for arm, grid, pick in grids:
            cells = []
            for lr in lrs:
                text = _cell(grid[lr]) if lr in grid else ""
                cells.append(f"**{text}**" if pick is not None and lr == pick[0] else text)
            chosen = "pending" if pick is None else f"lr {fmt(pick[0])}" + (
                f", scale_lr {fmt(pick[1])}" if pick[1] is not None else "")
            rows.append(f"| {arm.rung} | {arm.scale} {part.optim} | " + " | ".join(cells) + f" | {chosen} |")
        if part.scale_lr is not None:
            sites = [step(part.scale_lr, -1), part.scale_lr, step(part.scale_lr, 1)]
            rows.append("\nThe scale sites' LR at each arm's best matrix LR (same seeds):\n")
            rows.append("| rung | arm | lr | " + " | ".join(f"scale_lr {fmt(s)}" for s in sites) + " |")
            rows.append("|---|---|---:|" + "---:|" * len(sites))
            for arm, _, pick in grids:
                if pick is None:
                    continue
                cells = []
                for slr in sites:
                    values = arm.losses([arm.run(pick[0], s, slr) for s in pick[2]])
                    text = "" if None in values else _cell(values)
                    cells.append(f"**{text}**" if slr == pick[1] else text)
                rows.append(f"| {arm.rung} | {arm.scale} {part.optim} | {fmt(pick[0])} | " + " | ".join(cells) + " |")
        (out / f"{name}_grid.md").write_text("\n".join(rows) + "\n")
        (out / f"{name}_final.txt").write_text("".join(f"{d}\n" for d in finals))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "next":
        return next_run(Path(argv[1]), int(argv[2]), argv[3:])
    if len(argv) == 4 and argv[0] == "done":
        return done(Path(argv[1]), argv[2], int(argv[3]))
    if len(argv) >= 3 and argv[0] == "report":
        return report(Path(argv[1]), Path(argv[2]), argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

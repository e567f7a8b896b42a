"""Learning-rate grids per ladder rung, run as a queue (scripts/run_study.sh lr_ladder;
docs/results/each-arm-at-its-best-lr.md).

  lr_grid.py next ROOT PID PART...  claims the next run to train (longest first) for the worker PID
                                    and prints its `rung run_dir override...`; prints nothing and
                                    exits 3 while the runs still to come wait on runs in progress,
                                    exits 4 when every run of the parts is done
  lr_grid.py done ROOT RUN_DIR RC   releases the claim on a run that ended with exit status RC: 3
                                    (the trainer's "diverged") keeps it as failed; another error
                                    stops the worker (exit 1); a signal leaves it to be trained
                                    again
  lr_grid.py report ROOT OUT_DIR PART...   each part's grid and picks (OUT_DIR/<part>_grid.md, and
                                    its loss-against-LR plot per rung, <part>_grid.png), the run
                                    directories of its final seeds (<part>_final.txt), and every
                                    grid's pick per rung with its drift in grid steps
                                    (OUT_DIR/transfer.md), and the core-hours of training per rung
                                    (OUT_DIR/cost.md)

A part is an optimizer with its grid (PARTS below); per rung and strategy (an arm) it goes through:
  1. grid: the peak LR (optim.lr: every parameter but the scale sites, which have scale_lr when set)
     on the 1-3-10 sequence, the part's seeds, each run a WSD trunk to 10 tokens per parameter;
  2. widen: while the best LR (lowest mean terminal val_loss over the seeds) is at the grid's edge,
     the next LR beyond it;
  3. tie-break: where the two best LRs are closer than either one's spread over the seeds, the
     tie-break seed at both, and the better by the mean over all seeds;
  4. sites: at the best LR, the scale sites' LR one grid step down and up (same seeds); the pick is
     the best of the three;
  5. final: the pick with the final seeds, trunks and their WSD branches to 2.5 and 5 tokens per
     parameter (a part without trunks: WSD runs of their own at 2.5 and 5).
A part `tuned_on` another part's rung skips 1-4: every rung takes that rung's pick (the ladder tuned
once).
A part `around` another part's rung starts its grid at that rung's pick and one step either side (a
check of the pick on a larger rung), then widens as in 2.
A run is done when its last checkpoint is complete (checkpoints/step_<train.steps>/COMPLETE). A run
that diverged (non-finite steps past train.max_bad_steps) counts as the worst point of its grid and
is written as failed; its log says why. Claims (ROOT_logs/<name>.claim) hold what a worker trains,
so two workers never take one run; `next` clears the claims of workers that are gone.

`lr_grid.py --archive DIR <command> ...` keeps what the tables need of every finished run (ARCHIVED:
its config, metrics and describe.json, no checkpoints; of the scale sites' statistics, 99% of a
unified run's metrics, only the last log's; a diverged run's .failed note) in DIR/<name>/, a
folder kept in git, so a study spread over machines whose run directories do not last goes on from a
fresh clone: a run archived counts as done. A WSD branch needs its trunk's checkpoints, so the queue
takes a branch first once its trunk has finished under ROOT, and trains an archived trunk again
under ROOT where a branch of it is still to come; on another machine the same seed gives a close
run, not the same one, and the new trunk's record replaces the archived one, so a trunk and its
branches stay one run.
"""

import fcntl
import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import OmegaConf

# the 1-3-10 grid of LRs, 1e-5 .. 3
SEQUENCE = [float(f"{m}e{e}") for e in range(-5, 1) for m in (1, 3)]
# every rung a part may train, largest first (MoE rungs by their active parameters, beside their
# dense twins)
LADDER = ("dense-l6", "moe-l4", "dense-l4", "moe-l3", "dense-l3", "moe-l2", "dense-l2", "dense-l1")
RUNGS = ("dense-l3", "dense-l2", "dense-l1")
SCALES = ("baseline", "unified")
BRANCHES = (2.5, 5.0)
FAILED = float("inf")
# what --archive keeps of a run
ARCHIVED = ("config.yaml", "metrics.jsonl", "describe.json", "resumes.jsonl")


@dataclass(frozen=True)
class Part:
    optim: str
    lrs: tuple[float, ...]  # the first grid
    seeds: tuple[int, ...]
    # the seed added where the two best LRs are within the seeds' spread
    tiebreak: int | None = None
    scale_lr: float | None = None  # the sites' LR during the grid
    sites: bool = True  # with scale_lr: the sites' LR one step either side of the pick
    final: tuple[int, ...] = ()  # seeds at the pick, with WSD branches
    # False: the final's budgets below 10 as WSD runs of their own, and no trunk (a rung whose
    # trunk outlasts the machine's run directories)
    trunks: bool = True
    overrides: tuple[str, ...] = ()
    tag: str = ""  # in every run's name, for the overrides
    rungs: tuple[str, ...] = RUNGS
    scales: tuple[str, ...] = SCALES
    tuned_on: tuple[str, str] | None = None  # (part, rung) whose pick every rung takes
    # (rung, scale, lr, scale_lr) picked by an earlier grid
    picks: tuple[tuple[str, str, float, float], ...] = ()
    # (part, rung) whose pick, and a step either side, is the first grid
    around: tuple[str, str] | None = None
    # the grid's budget: below 10, its runs are WSD runs of that length of their own
    grid_tpp: float = 10.0
    # every grid trunk also branches to this budget; the report picks there too
    check_tpp: float | None = None
    # every grid trunk also branches to the final's budgets as it finishes, so a trunk picked later
    # (by runs on another machine, which lacks its checkpoints) need not be trained again for its
    # branches
    branch_grid: bool = False
    stage: int = 0  # the queue takes a lower stage first (what is cut when time is short goes last)


LRS = (0.001, 0.003, 0.01, 0.03)
# model.parameterization=mup with dense-l1 (width 32, one block) as the base shape; the ladder's
# heads keep their width (32), so the attention scale is sp's
MUP = ("model.parameterization=mup", "model.base_dim=32", "model.base_layers=1")
PARTS = {
    # issue 47, item 1: every rung at each arm's own best LR, the sites at optim.scale_lr=0.01
    "adamw": Part("adamw", LRS, seeds=(0, 1), tiebreak=2, scale_lr=0.01, final=(0, 1, 2)),
    # item 4: the same grid under mup (the sites' LR kept at the grid's: transfer is about one LR)
    "mup_adamw": Part("adamw", LRS, seeds=(0, 1), tiebreak=2, scale_lr=0.01, sites=False,
                      overrides=MUP, tag="mup"),
    # item 5: the ladder tuned once, every rung at mup's dense-l1 pick
    "mup_tuned": Part("adamw", LRS, seeds=(0, 1), scale_lr=0.01, final=(0, 1, 2), overrides=MUP,
                      tag="mup", tuned_on=("mup_adamw", "dense-l1")),
    # item 4's dense-l4 check: three points around mup's dense-l1 pick, one seed (the budget's
    # limit)
    "mup_l4": Part("adamw", (), seeds=(0,), scale_lr=0.01, sites=False, overrides=MUP, tag="mup",
                   rungs=("dense-l4",), around=("mup_adamw", "dense-l1")),
    # the Muon ladder's grid (its settings) on one seed per rung: a check of its dense-l2 picks; and
    # under mup
    "muon": Part("muon", LRS, seeds=(0,)),
    "mup_muon": Part("muon", LRS, seeds=(0,), overrides=MUP, tag="mup"),
}
# Does unified's gain grow with scale (docs/results/)? The AdamW ladder at each arm's own best LR,
# upward from dense-l3 (whose grid picked 3e-3 for both arms, the sites at scale_lr 0.01: the grids
# start there), and its MoE twin. dense-l4's grid trunks also branch to 2.5 tokens per parameter:
# where the short budget picks the long one's LR, the larger rungs' grids run at 2.5 only. In the
# queue's order; what is cut when the budget runs out goes last: dense-l6's third seed, then moe-l4.
# dense-l6's trunk would take about three hours of a core, longer than a run directory lasts here:
# its picks run at 2.5 and 5 tokens per parameter only, each a WSD run of its own (the same
# schedule, steps and data as the trunk's branch).
GROW = dict(seeds=(0, 1), tiebreak=2, scale_lr=0.01, sites=False, branch_grid=True)
SCALING = {
    "dense_l4": Part("adamw", (0.001, 0.003, 0.01), final=(0, 1, 2), rungs=("dense-l4",),
                     check_tpp=2.5, stage=1, **GROW),
    # the rungs below at the picks of their grids (the adamw part above;
    # docs/results/lr_ladder/adamw_grid.md), trained again for the trend's curves: the same seeds
    # give the same runs on the same machine
    "dense_l1_l3": Part("adamw", (), seeds=(0, 1), scale_lr=0.01, final=(0, 1, 2), stage=2, picks=(
        ("dense-l1", "baseline", 0.003, 0.003), ("dense-l1", "unified", 0.003, 0.03),
        ("dense-l2", "baseline", 0.001, 0.03), ("dense-l2", "unified", 0.003, 0.03),
        ("dense-l3", "baseline", 0.003, 0.01), ("dense-l3", "unified", 0.003, 0.01))),
    "moe_l2": Part("adamw", (0.001, 0.003, 0.01), final=(0, 1, 2), rungs=("moe-l2",), stage=3,
                   **GROW),
    "moe_l3": Part("adamw", (), final=(0, 1, 2), rungs=("moe-l3",), around=("moe_l2", "moe-l2"),
                   stage=4, **GROW),
    "dense_l6": Part("adamw", (), final=(0, 1), rungs=("dense-l6",),
                     around=("dense_l4", "dense-l4"), grid_tpp=2.5, trunks=False, stage=5,
                     **GROW),
    "moe_l4": Part("adamw", (), final=(0, 1, 2), rungs=("moe-l4",), around=("moe_l3", "moe-l3"),
                   grid_tpp=2.5, stage=6, **GROW),
    "dense_l6_s2": Part("adamw", (), final=(2,), rungs=("dense-l6",),
                        tuned_on=("dense_l6", "dense-l6"), trunks=False, stage=7, **GROW),
}
PARTS.update(SCALING)


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
    # below 10 tokens per parameter: a run of its own, not a branch of the trunk
    standalone: bool = False

    @property
    def name(self) -> str:
        sites = f"-scale_lr{fmt(self.scale_lr)}" if self.scale_lr is not None else ""
        tag = f"-{self.part.tag}" if self.part.tag else ""
        return (f"{self.rung}-{self.scale}-{self.part.optim}{tag}-lr{fmt(self.lr)}{sites}"
                f"-tpp{self.tpp:g}-s{self.seed}")

    def overrides(self, root: Path) -> list[str]:
        args = [f"scale={self.scale}", f"optim={self.part.optim}", f"optim.lr={fmt(self.lr)}",
                f"seed={self.seed}", *self.part.overrides]
        if self.scale_lr is not None:
            args.append(f"optim.scale_lr={fmt(self.scale_lr)}")
        if self.tpp != 10.0:
            args.append(f"train.tokens_per_param={self.tpp:g}")
            if not self.standalone:
                trunk = Run(self.rung, self.scale, self.part, self.lr, self.scale_lr, self.seed)
                args.append(f"branch_from={root / trunk.name}")
        return args + [f"run_dir={root / self.name}"]


def finished(run_dir: Path) -> bool:
    """Whether a run directory's last checkpoint is complete."""
    config = run_dir / "config.yaml"
    return config.is_file() and (
        run_dir / "checkpoints" / f"step_{OmegaConf.load(config).train.steps:06d}"
        / "COMPLETE").is_file()


class State:
    """What ROOT (and the archive) holds: each run done (its terminal val_loss), failed, or not
    yet."""

    def __init__(self, root: Path, archive: Path | None = None):
        self.root, self.logs, self.archive = root, Path(f"{root}_logs"), archive
        self.done = {}  # run name -> its terminal val_loss, read once

    def loss(self, run: Run) -> float | None:
        if run.name not in self.done:
            loss = self._read(run)
            if loss is None:
                return None
            self.done[run.name] = loss
        return self.done[run.name]

    def in_root(self, run: Run) -> bool:
        """Whether the run has finished under ROOT, checkpoints and all."""
        return finished(self.root / run.name)

    def where(self, run: Run) -> Path | None:
        """The directory of a finished run: under ROOT, else in the archive; None while not
        finished."""
        if self.in_root(run):
            return self.root / run.name
        if self.archive is not None and (self.archive / run.name / "metrics.jsonl").is_file():
            return self.archive / run.name
        return None

    def _read(self, run: Run) -> float | None:
        notes = [self.logs] + ([] if self.archive is None else [self.archive])
        if any((d / f"{run.name}.failed").is_file() for d in notes):
            return FAILED
        d = self.where(run)
        if d is None:
            return None
        # the trainer evaluates at the last step: the newest record with val_loss
        last = next((r["val_loss"]
                     for r in map(json.loads,
                                  reversed((d / "metrics.jsonl").read_text().splitlines()))
                     if "val_loss" in r), None)
        return FAILED if last is None or last != last else float(last)


class Arm:
    """One rung and strategy of a part: its stages, the runs each needs, and what they found."""

    def __init__(self, part: Part, rung: str, scale: str, state: State):
        self.part, self.rung, self.scale, self.state = part, rung, scale, state

    def run(self, lr, seed, scale_lr="grid", tpp=10.0) -> Run:
        return Run(self.rung, self.scale, self.part, lr,
                   self.part.scale_lr if scale_lr == "grid" else scale_lr, seed, tpp)

    def grid_run(self, lr, seed, scale_lr="grid") -> Run:
        """A run of the grid (stages 1-4), at the part's grid budget."""
        tpp = self.part.grid_tpp
        return replace(self.run(lr, seed, scale_lr, tpp), standalone=tpp != 10.0)

    def losses(self, runs):
        return [self.state.loss(r) for r in runs]

    def mean(self, lr, seeds, scale_lr="grid"):
        values = self.losses([self.grid_run(lr, s, scale_lr) for s in seeds])
        return None if None in values else statistics.fmean(values)

    def plan(self):
        """(runs still needed, None) or ([], the pick (lr, scale_lr, seeds)) when the grid is
        decided."""
        p = self.part
        fixed = [(lr, slr) for rung, scale, lr, slr in p.picks
                 if (rung, scale) == (self.rung, self.scale)]
        if fixed:
            return [], (*fixed[0], p.final)
        if p.tuned_on is not None:
            name, rung = p.tuned_on
            return Arm(PARTS[name], rung, self.scale, self.state).plan()
        lrs = sorted(p.lrs)
        if p.around is not None:
            name, rung = p.around
            pending, pick = Arm(PARTS[name], rung, self.scale, self.state).plan()
            if pick is None:
                return pending, None
            lrs = [step(pick[0], -1), pick[0], step(pick[0], 1)]
        while True:  # 1, 2: the grid, widened while its best is at an edge
            runs = [self.grid_run(lr, s) for lr in lrs for s in p.seeds]
            pending = [r for r in runs if self.state.loss(r) is None]
            if pending:
                return pending, None
            means = {lr: self.mean(lr, p.seeds) for lr in lrs}
            best = min(lrs, key=lambda lr: means[lr])
            if means[best] == FAILED:
                raise SystemExit(f"error: every LR of {self.rung} {self.scale} {p.optim} failed; "
                                 f"their logs: {self.state.logs}/")
            edge = -1 if best == lrs[0] else 1 if best == lrs[-1] else 0
            if edge == 0 or step(best, edge) == best:
                break
            lrs.append(step(best, edge))
            lrs.sort()
        seeds = p.seeds
        if p.tiebreak is not None:  # 3
            first, second = sorted(lrs, key=lambda lr: means[lr])[:2]
            spread = max(_range(self.losses([self.grid_run(lr, s) for s in p.seeds]))
                         for lr in (first, second))
            if abs(means[first] - means[second]) < spread:
                seeds = (*p.seeds, p.tiebreak)
                runs = [self.grid_run(lr, s) for lr in (first, second) for s in seeds]
                pending = [r for r in runs if self.state.loss(r) is None]
                if pending:
                    return pending, None
                best = min((first, second), key=lambda lr: self.mean(lr, seeds))
        if p.scale_lr is None or not p.sites:
            return [], (best, p.scale_lr, seeds)
        # 4: on a tie the grid's own stays
        sites = [p.scale_lr, step(p.scale_lr, -1), step(p.scale_lr, 1)]
        runs = [self.grid_run(best, s, slr) for slr in sites for s in seeds]
        pending = [r for r in runs if self.state.loss(r) is None]
        if pending:
            return pending, None
        slr = min(sites, key=lambda x: self.mean(best, seeds, x))
        return [], (best, slr, seeds)

    def final_runs(self, pick) -> list[Run]:
        lr, slr, _ = pick
        if not self.part.trunks:
            return [replace(self.run(lr, s, slr, tpp), standalone=True)
                    for s in self.part.final for tpp in BRANCHES]
        trunks = [self.run(lr, s, slr) for s in self.part.final]
        return trunks + [self.run(lr, t.seed, slr, tpp) for t in trunks for tpp in BRANCHES]

    def check_runs(self) -> list[Run]:
        """With check_tpp (and branch_grid): the branch to that budget (and to the final's) of every
        grid trunk that has finished."""
        p = self.part
        budgets = sorted({*(() if p.check_tpp is None else (p.check_tpp,)),
                          *(BRANCHES if p.branch_grid else ())})
        if not budgets or p.grid_tpp != 10.0:  # a shorter grid's runs are not trunks
            return []
        seeds = (*p.seeds, *(() if p.tiebreak is None else (p.tiebreak,)))
        trunks = [self.grid_run(lr, s) for lr in SEQUENCE for s in seeds]
        return [self.run(t.lr, t.seed, tpp=tpp) for t in trunks
                if self.state.loss(t) not in (None, FAILED)
                for tpp in budgets]

    def needed(self) -> list[Run]:
        pending, pick = self.plan()
        checks = [r for r in self.check_runs() if self.state.loss(r) is None]
        if pick is None:
            return pending + checks
        out = checks
        for r in self.final_runs(pick):
            if self.state.loss(r) is not None:
                continue
            trunk = self.run(r.lr, r.seed, r.scale_lr)
            if r.tpp == 10.0 or r.standalone or self.state.loss(trunk) not in (None, FAILED):
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


def next_run(root: Path, pid: int, parts: list[str], archive: Path | None = None) -> int:
    state = State(root, archive)
    state.logs.mkdir(parents=True, exist_ok=True)
    with open(state.logs / ".queue.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        claimed = set()
        for claim in state.logs.glob("*.claim"):
            if _alive(int(claim.read_text() or 0)):
                claimed.add(claim.name[: -len(".claim")])
            else:
                claim.unlink()

        def trunk(run: Run) -> Run | None:
            return None if run.tpp == 10.0 or run.standalone else replace(run, tpp=10.0)

        def order(job: tuple[str, str, Run]) -> tuple:
            # a branch whose trunk has its checkpoints here first (short, and what a lost run
            # directory would cost most); then Muon's grids last (issue 47: cut first when time is
            # short), then the lower stage; then the smallest rung first, every part's (its picks,
            # and what they say about transfer, come before the long runs of the largest rung); then
            # the parts in their order, trunks before branches
            name, rung, run = job
            part = PARTS[name]
            return (trunk(run) is None, part.optim == "muon", part.stage, -LADDER.index(rung),
                    parts.index(name), run.tpp != 10.0)

        # a branch of a trunk known only from the archive asks for the trunk again, under ROOT
        jobs = {}
        for name, arm in arms(parts, state):
            for r in arm.needed():
                t = trunk(r)
                r = r if t is None or state.in_root(t) else t
                jobs.setdefault(r.name, (name, r.rung, r))
        needed = sorted(jobs.values(), key=order)
        free = [(rung, r) for _, rung, r in needed if r.name not in claimed]
        if not free:
            return 3 if needed else 4
        rung, run = free[0]
        (state.logs / f"{run.name}.claim").write_text(str(pid))
        print(rung, root / run.name, *run.overrides(root))
    return 0


def slim_metrics(text: str) -> str:
    """A run's metrics.jsonl without the scale sites' statistics (scale/...) but in its last record
    that has them: every loss, evaluation and throughput kept."""
    records = [json.loads(line) for line in text.splitlines()]
    last = max((i for i, r in enumerate(records) if any(k.startswith("scale/") for k in r)),
               default=None)
    return "".join(json.dumps(r if i == last
                              else {k: v for k, v in r.items() if not k.startswith("scale/")})
                   + "\n" for i, r in enumerate(records))


def done(root: Path, run_dir: str, rc: int, archive: Path | None = None) -> int:
    logs = Path(f"{root}_logs")
    name = Path(run_dir).name
    (logs / f"{name}.claim").unlink(missing_ok=True)
    if rc == 3:
        note = f"diverged (exit status 3); log: {logs / name}.log\n"
        for d in [logs] + ([] if archive is None else [archive]):
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{name}.failed").write_text(note)
    elif rc != 0 and rc < 128:
        print(f"error: {run_dir} failed with exit status {rc}; its log: {logs / name}.log",
              file=sys.stderr)
        return 1
    elif rc == 0 and archive is not None:
        src = root / name
        if finished(src):
            # written aside, then moved into place: a copy cut short is never read as a finished run
            part = archive / f".{name}.part"
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir(parents=True)
            for f in ARCHIVED:
                if f == "metrics.jsonl":
                    (part / f).write_text(slim_metrics((src / f).read_text()))
                elif (src / f).is_file():
                    shutil.copyfile(src / f, part / f)
            shutil.rmtree(archive / name, ignore_errors=True)
            part.rename(archive / name)
    return 0


def _cell(values):
    if FAILED in values:
        return "failed"
    text = f"{statistics.fmean(values):.4f}"
    return text + (" (" + ", ".join(f"{v:.3f}" for v in values) + ")" if len(values) > 1 else "")


def grid(arm: Arm) -> dict[float, list[float]]:
    """Every LR of the arm's grid run on all of its part's seeds: the terminal val_loss per seed
    (the tie-break seed's too where it ran)."""
    part, out = arm.part, {}
    for lr in SEQUENCE:
        values = arm.losses([arm.grid_run(lr, s) for s in part.seeds])
        if None not in values:
            extra = [] if part.tiebreak is None else arm.losses([arm.grid_run(lr, part.tiebreak)])
            out[lr] = values + [v for v in extra if v is not None]
    return out


def grid_table(name: str, state: State) -> tuple[str, list[str]]:
    """The part's grid per rung and arm with each pick, the sites' LR either side of it, and the run
    directories of the pick's final seeds."""
    part = PARTS[name]
    found = [(arm, grid(arm), arm.plan()[1]) for _, arm in arms([name], state)]
    finals = [str(state.where(r)) for arm, _, pick in found if pick is not None
              for r in arm.final_runs(pick) if state.loss(r) not in (None, FAILED)]
    if part.tuned_on is not None:
        picks = ", ".join(f"{arm.scale} lr {fmt(pick[0])}"
                          for arm, _, pick in found[:len(part.scales)] if pick)
        return (f"Every rung at {part.tuned_on[0]}'s {part.tuned_on[1]} pick: "
                f"{picks or 'pending'}.\n", finals)
    if part.picks:
        rows = ["Each arm at the pick of an earlier grid (no grid here):\n",
                "| rung | arm | lr | scale_lr |", "|---|---|---:|---:|"]
        rows += [f"| {rung} | {scale} {part.optim} | {fmt(lr)} | {fmt(slr)} |"
                 for rung, scale, lr, slr in part.picks]
        return "\n".join(rows) + "\n", finals
    lrs = sorted({lr for _, g, _ in found for lr in g})
    seeds = (f"seed {part.seeds[0]}" if len(part.seeds) == 1 else
             f"mean over seeds {', '.join(map(str, part.seeds))}" + (
                 "" if part.tiebreak is None else
                 f", and seed {part.tiebreak} where it ran (the tie-break where "
                 "the two best were within the seeds' spread, or a final seed "
                 "of the pick)") + "; each seed's in brackets")
    rows = [f"Terminal val_loss at {part.grid_tpp:g} tokens per parameter, {seeds}; "
            "the pick in bold.\n",
            "| " + " | ".join(["rung", "arm", *(f"lr {fmt(lr)}" for lr in lrs), "pick"]) + " |",
            "|---|---|" + "---:|" * (len(lrs) + 1)]
    for arm, g, pick in found:
        cells = [(f"**{_cell(g[lr])}**" if pick and lr == pick[0] else _cell(g[lr]))
                 if lr in g else "" for lr in lrs]
        chosen = "pending" if pick is None else f"lr {fmt(pick[0])}" + (
            f", scale_lr {fmt(pick[1])}" if pick[1] is not None else "")
        rows.append("| " + " | ".join([arm.rung, f"{arm.scale} {part.optim}", *cells, chosen])
                    + " |")
    if part.scale_lr is not None and part.sites:
        sites = [step(part.scale_lr, -1), part.scale_lr, step(part.scale_lr, 1)]
        rows += ["\nThe scale sites' LR at each arm's best LR (same seeds):\n",
                 "| rung | arm | lr | " + " | ".join(f"scale_lr {fmt(x)}" for x in sites) + " |",
                 "|---|---|---:|" + "---:|" * len(sites)]
        for arm, _, pick in found:
            if pick is None:
                continue
            cells = []
            for slr in sites:
                values = arm.losses([arm.grid_run(pick[0], x, slr) for x in pick[2]])
                text = "" if None in values else _cell(values)
                cells.append(f"**{text}**" if slr == pick[1] else text)
            rows.append(f"| {arm.rung} | {arm.scale} {part.optim} | {fmt(pick[0])} | "
                        + " | ".join(cells) + " |")
    if part.check_tpp is not None:
        rows += [f"\nThe same grid at {part.check_tpp:g} tokens per parameter (each trunk's WSD "
                 f"branch), mean over seeds {', '.join(map(str, part.seeds))}; its best in bold, "
                 "against the pick above:\n",
                 "| " + " | ".join(["rung", "arm", *(f"lr {fmt(lr)}" for lr in lrs), "best",
                                    "same LR as the pick"])
                 + " |",
                 "|---|---|" + "---:|" * (len(lrs) + 2)]
        for arm, _, pick in found:
            short = {lr: arm.losses([arm.run(lr, s, tpp=part.check_tpp) for s in part.seeds])
                     for lr in lrs}
            short = {lr: v for lr, v in short.items() if None not in v}
            best = min(short, key=lambda lr: statistics.fmean(short[lr])) if short else None
            cells = [(f"**{_cell(short[lr])}**" if lr == best else _cell(short[lr]))
                     if lr in short else "" for lr in lrs]
            same = ("pending" if pick is None or best is None
                    else ("yes" if best == pick[0] else "no"))
            rows.append("| " + " | ".join([arm.rung, f"{arm.scale} {part.optim}", *cells,
                                           "pending" if best is None else f"lr {fmt(best)}", same])
                        + " |")
    return "\n".join(rows) + "\n", finals


def transfer_table(names: list[str], state: State) -> str:
    """Each part's pick per rung and arm (a part `around` it adds its larger rung to its row), and
    how many grid steps it moves from rung to rung."""
    checks = {PARTS[n].around[0]: n for n in names if PARTS[n].around is not None}
    rows_of = {n: [(n, r) for r in PARTS[n].rungs]
               + ([(checks[n], r) for r in PARTS[checks[n]].rungs] if n in checks else [])
               for n in names if PARTS[n].around is None}
    rungs = sorted({r for cells in rows_of.values() for _, r in cells},
                   key=lambda r: -LADDER.index(r))
    rows = ["| arm | part | " + " | ".join(rungs) + " | steps per rung | smallest to largest |",
            "|---|---|" + "---:|" * (len(rungs) + 2)]
    for name, cells_of in rows_of.items():
        for scale in PARTS[name].scales:
            picks = {}
            for part, rung in cells_of:
                pick = Arm(PARTS[part], rung, scale, state).plan()[1]
                picks[rung] = None if pick is None else pick[0]
            ordered = sorted(picks, key=lambda r: -LADDER.index(r))
            known = [picks[r] for r in ordered if picks[r] is not None]
            moves = [round(math.log(b / a) / math.log(10) * 2) for a, b in zip(known, known[1:])]
            cells = [("pending" if picks[r] is None else fmt(picks[r])) if r in picks else ""
                     for r in rungs]
            whole = f"{sum(moves):+d}" if None not in picks.values() else ""
            rows.append(f"| {scale} {PARTS[name].optim} | {name} | " + " | ".join(cells) + " | "
                        + ", ".join(f"{m:+d}" for m in moves) + f" | {whole} |")
    return "\n".join(rows) + "\n"


def plot(name: str, state: State, path: Path) -> None:
    """Terminal val_loss against the LR, a panel per rung, a line per arm (the seeds' range as
    bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    part = PARTS[name]
    fig, axes = plt.subplots(1, len(part.rungs), figsize=(4.2 * len(part.rungs), 3.4),
                             squeeze=False)
    for ax, rung in zip(axes[0], sorted(part.rungs, key=lambda r: -LADDER.index(r)), strict=True):
        for scale in part.scales:
            g = {lr: v for lr, v in grid(Arm(part, rung, scale, state)).items() if FAILED not in v}
            if not g:
                continue
            lrs = sorted(g)
            means = [statistics.fmean(g[lr]) for lr in lrs]
            low = [m - min(g[lr]) for m, lr in zip(means, lrs, strict=True)]
            high = [max(g[lr]) - m for m, lr in zip(means, lrs, strict=True)]
            ax.errorbar(lrs, means, yerr=[low, high], marker="o", capsize=3, label=scale)
        ax.set(xscale="log", xlabel="peak LR (optim.lr)", ylabel="terminal val_loss",
               title=f"{rung} ({name})")
        if ax.lines:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def training_hours(run_dir: Path) -> float:
    """Hours of one core the run's training steps took: each logged interval's tokens over its
    logged throughput (one worker trains on one core), from its branch point on for a WSD branch
    (evaluations, checkpoints and compilation are not counted)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = max((i for i, r in enumerate(records) if "branch_from" in r), default=0)
    seconds, tokens = 0.0, next((r["tokens"] for r in reversed(records[:start])
                                 if "tokens" in r), None)
    for r in records[start:]:
        if "tokens_per_s" in r and tokens is not None:
            seconds += (r["tokens"] - tokens) / r["tokens_per_s"]
        if "tokens" in r:
            tokens = r["tokens"]
    return seconds / 3600


def cost_table(root: Path, archive: Path | None = None) -> str:
    """Core-hours of training per rung over every run under root and in the archive (a run in both
    once: the archive's, which finished)."""
    runs = {}
    for top in (root, *(() if archive is None else (archive,))):
        if top.is_dir():
            runs.update({d.name: d for d in sorted(top.iterdir()) if not d.name.startswith(".")})
    hours: dict[str, list[float]] = {}
    for d in runs.values():
        if (d / "metrics.jsonl").is_file() and (d / "config.yaml").is_file():
            hours.setdefault(OmegaConf.load(d / "config.yaml").model.name, []).append(
                training_hours(d))
    rows = ["| rung | runs | core-hours of training |", "|---|---:|---:|"]
    for rung, h in sorted(hours.items(), key=lambda item: -LADDER.index(item[0])):
        rows.append(f"| {rung} | {len(h)} | {sum(h):.1f} |")
    total = sum(sum(h) for h in hours.values())
    return "\n".join(rows + [f"| all | {sum(map(len, hours.values()))} | {total:.1f} |"]) + "\n"


def report(root: Path, out: Path, parts: list[str], archive: Path | None = None) -> int:
    state = State(root, archive)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost.md").write_text(cost_table(root, archive))
    for name in parts:
        text, finals = grid_table(name, state)
        (out / f"{name}_grid.md").write_text(text)
        (out / f"{name}_final.txt").write_text("".join(f"{d}\n" for d in finals))
        if PARTS[name].tuned_on is None:
            plot(name, state, out / f"{name}_grid.png")
    grids = [n for n in parts if PARTS[n].tuned_on is None]
    (out / "transfer.md").write_text(transfer_table(grids, state))
    return 0


def main(argv: list[str]) -> int:
    archive = None
    if len(argv) >= 2 and argv[0] == "--archive":
        archive, argv = Path(argv[1]), argv[2:]
    if len(argv) >= 3 and argv[0] == "next":
        return next_run(Path(argv[1]), int(argv[2]), argv[3:], archive)
    if len(argv) == 4 and argv[0] == "done":
        return done(Path(argv[1]), argv[2], int(argv[3]), archive)
    if len(argv) >= 3 and argv[0] == "report":
        return report(Path(argv[1]), Path(argv[2]), argv[3:], archive)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

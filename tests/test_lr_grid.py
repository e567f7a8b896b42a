"""scripts/lr_grid.py, the queue of issue 47's LR grids: what it asks to train next for a given
state of finished runs, written here as run directories that hold only what the queue reads
(config.yaml's train.steps, the last checkpoint's COMPLETE marker, metrics.jsonl's last
val_loss)."""

import importlib.util
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lr_grid.py"
spec = importlib.util.spec_from_file_location("lr_grid", SCRIPT)
lr_grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lr_grid)

PART = lr_grid.Part("adamw", (0.001, 0.003, 0.01, 0.03), seeds=(0, 1), tiebreak=2, scale_lr=0.01,
                    final=(0, 1, 2), rungs=("dense-l1",), scales=("baseline",))


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setitem(lr_grid.PARTS, "test", PART)
    return tmp_path / "runs"


def finish(root: Path, name: str, loss: float) -> None:
    d = root / name
    (d / "checkpoints" / "step_000010").mkdir(parents=True)
    (d / "checkpoints" / "step_000010" / "COMPLETE").touch()
    (d / "config.yaml").write_text("train:\n  steps: 10\n")
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 9.0}) + "\n"
                                     + json.dumps({"step": 10, "val_loss": loss}) + "\n")


def needed(root: Path) -> list[str]:
    arm = lr_grid.Arm(PART, "dense-l1", "baseline", lr_grid.State(root))
    return sorted(r.name for r in arm.needed())


def name(lr, seed, scale_lr=0.01, tpp="10"):
    return f"dense-l1-baseline-adamw-lr{lr}-scale_lr{scale_lr}-tpp{tpp}-s{seed}"


def test_the_grid_widens_breaks_a_tie_tries_the_sites_then_trains_the_pick(root):
    assert needed(root) == sorted(name(lr, s)
                                  for lr in ("0.001", "0.003", "0.01", "0.03") for s in (0, 1))
    losses = {"0.001": (5.0, 5.0), "0.003": (4.8, 4.9), "0.01": (4.6, 4.7), "0.03": (4.5, 4.6)}
    for lr, pair in losses.items():
        for seed, loss in enumerate(pair):
            finish(root, name(lr, seed), loss)
    # the best (0.03) is at the grid's edge: the next LR up
    assert needed(root) == [name("0.1", 0), name("0.1", 1)]
    finish(root, name("0.1", 0), 4.56)
    finish(root, name("0.1", 1), 4.62)
    # 0.03 (4.55) and 0.1 (4.59) are closer than either's seed range (0.1, 0.06): a third seed at
    # both
    assert needed(root) == [name("0.03", 2), name("0.1", 2)]
    finish(root, name("0.03", 2), 4.9)  # 0.03 over three seeds: 4.667
    finish(root, name("0.1", 2), 4.5)  # 0.1: 4.56, the better
    assert needed(root) == sorted(name("0.1", s, slr)
                                  for s in (0, 1, 2) for slr in ("0.003", "0.03"))
    for s in (0, 1, 2):
        finish(root, name("0.1", s, "0.003"), 4.4)
        finish(root, name("0.1", s, "0.03"), 4.7)
    # the pick (lr 0.1, scale_lr 0.003) has all three seeds as trunks: their branches next
    assert needed(root) == sorted(name("0.1", s, "0.003", tpp)
                                  for s in (0, 1, 2) for tpp in ("2.5", "5"))


def test_a_diverged_run_is_the_worst_point_and_a_claim_is_never_taken_twice(root):
    for lr, loss in (("0.001", 5.0), ("0.003", 4.9), ("0.01", 4.8)):
        for s in (0, 1):
            finish(root, name(lr, s), loss + s * 0.01)
    logs = Path(f"{root}_logs")
    logs.mkdir()
    # lr 0.03 diverged on seed 0 (the trainer's exit status 3); seed 1 is still to train
    assert lr_grid.done(root, str(root / name("0.03", 0)), 3) == 0
    assert (logs / f"{name('0.03', 0)}.failed").is_file()
    assert needed(root) == [name("0.03", 1)]
    pid = os.getpid()
    assert lr_grid.next_run(root, pid, ["test"]) == 0
    assert (logs / f"{name('0.03', 1)}.claim").read_text() == str(pid)
    # the one run left is claimed by a live worker
    assert lr_grid.next_run(root, pid, ["test"]) == 3
    assert lr_grid.done(root, str(root / name("0.03", 1)), 1) == 1  # an error stops the worker
    assert not (logs / f"{name('0.03', 1)}.claim").exists()
    finish(root, name("0.03", 1), 7.0)
    # best 0.01 inside the grid (0.03 failed on one seed: the worst point); 0.01 and 0.003 are 0.1
    # apart, more than either's seed range: no third seed; the sites' LR next
    assert needed(root) == sorted(name("0.01", s, slr) for s in (0, 1) for slr in ("0.003", "0.03"))


def test_a_check_starts_around_another_parts_pick_and_muon_waits_for_every_other_part(
        root, monkeypatch):
    check = lr_grid.Part("adamw", (), seeds=(0,), scale_lr=0.01, sites=False, rungs=("dense-l4",),
                         scales=("baseline",), around=("test", "dense-l1"))
    muon = lr_grid.Part("muon", (0.001, 0.003, 0.01), seeds=(0,), rungs=("dense-l1",),
                        scales=("baseline",))
    monkeypatch.setitem(lr_grid.PARTS, "check", check)
    monkeypatch.setitem(lr_grid.PARTS, "muon_test", muon)
    state = lr_grid.State(root)
    arm = lr_grid.Arm(check, "dense-l4", "baseline", state)
    # until the dense-l1 grid has its pick, the check asks for that grid's runs
    assert sorted(r.name for r in arm.needed()) == needed(root)
    for lr, loss in (("0.001", 5.0), ("0.003", 4.7), ("0.01", 4.8), ("0.03", 4.9)):
        for s in (0, 1):
            finish(root, name(lr, s), loss + s * 0.01)
    for slr in ("0.003", "0.03"):
        for s in (0, 1):
            finish(root, name("0.003", s, slr), 4.75)
    # the pick is lr 3e-3: the check's grid is 1e-3, 3e-3 and 1e-2 on dense-l4
    l4 = [f"dense-l4-baseline-adamw-lr{lr}-scale_lr0.01-tpp10-s0"
          for lr in ("0.001", "0.003", "0.01")]
    assert sorted(r.name for r in arm.needed()) == l4
    # the queue: dense-l1's Muon grid is the smallest rung, yet comes after the dense-l4 check
    order = []
    logs = Path(f"{root}_logs")
    while lr_grid.next_run(root, os.getpid(), ["muon_test", "test", "check"]) == 0:
        (claim,) = logs.glob("*.claim")
        claim.unlink()
        order.append(claim.name[: -len(".claim")])
        # 3e-3 stays the best: no widening
        finish(root, order[-1], 4.0 if "-lr0.003-" in order[-1] else 4.5)
    assert set(order[-3:]) == {f"dense-l1-baseline-muon-lr{lr}-tpp10-s0"
                               for lr in ("0.001", "0.003", "0.01")}
    assert set(order[-6:-3]) == set(l4)
    # the transfer table carries the check's rung in its source part's row: 3e-3 on both, no step
    assert lr_grid.transfer_table(["test", "check"], lr_grid.State(root)).splitlines() == [
        "| arm | part | dense-l1 | dense-l4 | steps per rung | smallest to largest |",
        "|---|---|---:|---:|---:|---:|",
        "| baseline adamw | test | 0.003 | 0.003 | +0 | +0 |"]


def test_a_short_grid_and_a_check_budget_and_stages_and_fixed_picks(root, monkeypatch):
    """grid_tpp: the grid's runs are WSD runs of that budget of their own (no branch_from), and the
    pick's branch to that budget is the grid's run; check_tpp: every finished grid trunk branches to
    it too; the queue takes a lower stage first and prints each run's own rung; picks: a rung at a
    pick made before."""
    short = lr_grid.Part("adamw", (0.001, 0.003, 0.01), seeds=(0,), scale_lr=0.01, sites=False,
                         final=(0, 1),
                         rungs=("dense-l1",), scales=("baseline",), grid_tpp=2.5, stage=2)
    check = lr_grid.Part("adamw", (0.001, 0.003, 0.01), seeds=(0,), scale_lr=0.01, sites=False,
                         final=(0,),
                         rungs=("dense-l2",), scales=("baseline",), check_tpp=2.5, stage=1)
    fixed = lr_grid.Part("adamw", (), seeds=(0,), scale_lr=0.01, final=(0,), rungs=("dense-l3",),
                         scales=("baseline",), picks=(("dense-l3", "baseline", 0.003, 0.03),),
                         stage=3)
    for key, part in (("short", short), ("check", check), ("fixed", fixed)):
        monkeypatch.setitem(lr_grid.PARTS, key, part)
    state = lr_grid.State(root)
    arm = lr_grid.Arm(short, "dense-l1", "baseline", state)
    grid_names = [name(lr, 0, tpp="2.5") for lr in ("0.001", "0.003", "0.01")]
    assert sorted(r.name for r in arm.needed()) == grid_names
    assert all(r.standalone and not any(o.startswith("branch_from=") for o in r.overrides(root))
               for r in arm.needed())
    for lr, loss in (("0.001", 5.0), ("0.003", 4.7), ("0.01", 4.9)):
        finish(root, name(lr, 0, tpp="2.5"), loss)
    # the pick (3e-3) trains its trunks; seed 0's 2.5 branch is the grid's run, seed 1's waits for
    # its trunk
    assert sorted(r.name for r in arm.needed()) == [name("0.003", 0), name("0.003", 1)]
    # the queue: the check (stage 1) before the short grid (stage 2) before the fixed pick (stage
    # 3); a run is printed with its own rung
    logs = Path(f"{root}_logs")
    order = []
    for _ in range(4):  # this process holds every claim, so each call takes the next free run
        assert lr_grid.next_run(root, os.getpid(), ["fixed", "short", "check"]) == 0
        (new,) = {c.name[: -len(".claim")] for c in logs.glob("*.claim")} - set(order)
        order.append(new)
    l2 = [f"dense-l2-baseline-adamw-lr{lr}-scale_lr0.01-tpp10-s0"
          for lr in ("0.001", "0.003", "0.01")]
    assert set(order[:3]) == set(l2) and order[3] == name("0.003", 0)
    for claim in logs.glob("*.claim"):
        claim.unlink()
    for lr, loss in (("0.001", 4.0), ("0.003", 3.8), ("0.01", 3.9)):
        finish(root, f"dense-l2-baseline-adamw-lr{lr}-scale_lr0.01-tpp10-s0", loss)
    checker = lr_grid.Arm(check, "dense-l2", "baseline", lr_grid.State(root))
    branches = [f"dense-l2-baseline-adamw-lr{lr}-scale_lr0.01-tpp2.5-s0"
                for lr in ("0.001", "0.003", "0.01")]
    needed = checker.needed()
    assert set(branches) <= {r.name for r in needed}
    assert all(f"branch_from={root}/{b.replace('tpp2.5', 'tpp10')}" in r.overrides(root)
               for b in branches for r in needed if r.name == b)
    for lr, loss in (("0.001", 4.1), ("0.003", 4.2), ("0.01", 4.3)):
        finish(root, f"dense-l2-baseline-adamw-lr{lr}-scale_lr0.01-tpp2.5-s0", loss)
    table, _ = lr_grid.grid_table("check", lr_grid.State(root))
    # at 10 tokens per parameter 3e-3 is best; at 2.5, 1e-3: the check says they differ
    assert "| dense-l2 | baseline adamw | **4.1000** | 4.2000 | 4.3000 | lr 0.001 | no |" in table
    pick = lr_grid.Arm(fixed, "dense-l3", "baseline", lr_grid.State(root))
    assert ([r.name for r in pick.needed()]
            == ["dense-l3-baseline-adamw-lr0.003-scale_lr0.03-tpp10-s0"])
    table, _ = lr_grid.grid_table("fixed", lr_grid.State(root))
    assert table.splitlines()[2:] == ["| rung | arm | lr | scale_lr |", "|---|---|---:|---:|",
                                      "| dense-l3 | baseline adamw | 0.003 | 0.03 |"]


def test_a_part_without_trunks_trains_the_picks_budgets_as_runs_of_their_own(root, monkeypatch):
    """trunks=False: the pick's seeds run at 2.5 and 5 tokens per parameter, each a WSD run of its
    own (no branch_from, no trunk at 10); the grid's own 2.5 runs count for its seeds."""
    part = lr_grid.Part("adamw", (0.001, 0.003, 0.01), seeds=(0,), scale_lr=0.01, sites=False,
                        final=(0, 1), rungs=("dense-l1",), scales=("baseline",), grid_tpp=2.5,
                        trunks=False)
    monkeypatch.setitem(lr_grid.PARTS, "no_trunks", part)
    for lr, loss in (("0.001", 5.0), ("0.003", 4.7), ("0.01", 4.9)):
        finish(root, name(lr, 0, tpp="2.5"), loss)
    arm = lr_grid.Arm(part, "dense-l1", "baseline", lr_grid.State(root))
    runs = arm.needed()
    assert sorted(r.name for r in runs) == sorted([name("0.003", 0, tpp="5"),
                                                   name("0.003", 1, tpp="2.5"),
                                                   name("0.003", 1, tpp="5")])
    for r in runs:
        overrides = r.overrides(root)
        assert not any(o.startswith("branch_from=") for o in overrides)
        # the budget its name gives, which the ladder's 10 would otherwise be
        assert [o for o in overrides if o.startswith("train.tokens_per_param=")] == [
            f"train.tokens_per_param={r.tpp:g}"]
        assert r.standalone and f"run_dir={root / r.name}" in overrides
    # the queue hands them out as they are: no trunk is asked for
    assert lr_grid.next_run(root, os.getpid(), ["no_trunks"]) == 0
    (claim,) = Path(f"{root}_logs").glob("*.claim")
    assert "tpp10" not in claim.name


def test_a_grid_not_yet_known_has_a_table_of_whole_rows(root, monkeypatch):
    """A grid around another part's pick, that pick still pending: no LR columns, every row as wide
    as the header."""
    base = lr_grid.Part("adamw", (0.001, 0.003), seeds=(0,), scale_lr=0.01, sites=False,
                        rungs=("dense-l1",), scales=("baseline",))
    later = lr_grid.Part("adamw", (), seeds=(0,), scale_lr=0.01, sites=False, rungs=("dense-l2",),
                         scales=("baseline",), around=("base", "dense-l1"), check_tpp=2.5)
    monkeypatch.setitem(lr_grid.PARTS, "base", base)
    monkeypatch.setitem(lr_grid.PARTS, "later", later)
    table, _ = lr_grid.grid_table("later", lr_grid.State(root))
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows == ["| rung | arm | pick |", "|---|---|---:|",
                    "| dense-l2 | baseline adamw | pending |",
                    "| rung | arm | best | same LR as the pick |", "|---|---|---:|---:|",
                    "| dense-l2 | baseline adamw | pending | pending |"]


def test_the_cost_is_each_runs_logged_tokens_over_its_logged_throughput(tmp_path):
    """A trunk: 100 tokens at 10/s then 200 at 20/s (20 s); its branch counts only what follows its
    branch point (400 tokens at 40/s, 10 s)."""
    for name, model, records in (
            ("trunk", "dense-l1",
             [{"step": 0, "tokens": 0}, {"step": 1, "tokens": 100, "tokens_per_s": 10.0},
              {"step": 2, "tokens": 300, "tokens_per_s": 20.0}]),
            ("branch", "dense-l1",
             [{"step": 0, "tokens": 0}, {"step": 1, "tokens": 100, "tokens_per_s": 10.0},
              {"step": 1, "branch_from": "trunk/checkpoints/step_000001"},
              {"step": 2, "tokens": 500, "tokens_per_s": 40.0}]),
            ("other", "dense-l2",
             [{"step": 0, "tokens": 0}, {"step": 1, "tokens": 3600, "tokens_per_s": 1.0}])):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(f"model:\n  name: {model}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert lr_grid.training_hours(tmp_path / "trunk") == pytest.approx(20 / 3600)
    assert lr_grid.training_hours(tmp_path / "branch") == pytest.approx(10 / 3600)
    # smallest rung first
    assert lr_grid.cost_table(tmp_path).splitlines()[2:] == ["| dense-l1 | 2 | 0.0 |",
                                                             "| dense-l2 | 1 | 1.0 |",
                                                             "| all | 3 | 1.0 |"]
    # a run both here and in the archive counts once; one only archived counts too
    archive = tmp_path / "archive"
    for name in ("trunk", "other"):
        shutil.copytree(tmp_path / name, archive / name)
    shutil.rmtree(tmp_path / "other")
    assert lr_grid.cost_table(tmp_path, archive).splitlines()[2:] == [
        "| dense-l1 | 2 | 0.0 |", "| dense-l2 | 1 | 1.0 |", "| all | 3 | 1.0 |"]


def test_an_archived_study_goes_on_from_a_fresh_root_and_trains_a_trunk_again_for_its_branches(
        tmp_path, monkeypatch, capsys):
    """--archive: a finished run's record (no checkpoints) and a diverged run's note are kept; a
    fresh root (another machine) counts them as done; a branch still to come of an archived trunk
    trains the trunk again first, and a branch whose trunk is here goes before every other run."""
    part = lr_grid.Part("adamw", (0.001, 0.003, 0.01), seeds=(0,), scale_lr=0.01, sites=False,
                        final=(0,), rungs=("dense-l1",), scales=("baseline",), branch_grid=True)
    monkeypatch.setitem(lr_grid.PARTS, "grow", part)
    first, archive = tmp_path / "first" / "runs", tmp_path / "archive"
    finish(first, name("0.001", 0), 5.0)
    assert lr_grid.done(first, str(first / name("0.001", 0)), 0, archive) == 0
    assert (sorted(p.name for p in (archive / name("0.001", 0)).iterdir())
            == ["config.yaml", "metrics.jsonl"])
    # the scale sites' statistics only in the last record that has them
    records = [{"step": 1, "loss": 6.0, "scale/L0/a/mean": 1.0},
               {"step": 2, "loss": 5.5, "scale/L0/a/mean": 1.1}, {"step": 2, "val_loss": 5.0}]
    text = "".join(json.dumps(r) + "\n" for r in records)
    assert [json.loads(line) for line in lr_grid.slim_metrics(text).splitlines()] == [
        {"step": 1, "loss": 6.0}, {"step": 2, "loss": 5.5, "scale/L0/a/mean": 1.1},
        {"step": 2, "val_loss": 5.0}]
    # a run stopped cleanly before its end (a SIGTERM's checkpoint; exit status 0) is not archived
    stopped = first / name("0.01", 0)
    (stopped / "checkpoints" / "step_000004").mkdir(parents=True)
    (stopped / "config.yaml").write_text("train:\n  steps: 10\n")
    (stopped / "metrics.jsonl").write_text(json.dumps({"step": 4, "val_loss": 6.0}) + "\n")
    assert lr_grid.done(first, str(stopped), 0, archive) == 0
    assert not (archive / name("0.01", 0)).exists()
    shutil.rmtree(stopped)
    assert lr_grid.done(first, str(first / name("0.003", 0)), 3, archive) == 0
    assert (archive / f"{name('0.003', 0)}.failed").is_file()
    # on the first machine: the finished trunk's branches (2.5 and 5) come before the grid's last
    # trunk
    capsys.readouterr()
    for _ in range(3):
        assert lr_grid.next_run(first, os.getpid(), ["grow"], archive) == 0
    printed = [line.split()[1] for line in capsys.readouterr().out.splitlines()]
    assert printed == ([str(first / name("0.001", 0, tpp=t)) for t in ("2.5", "5")]
                       + [str(first / name("0.01", 0))])
    # a fresh root with the archive: the trunk's loss and the divergence are known, the trunk trains
    # again (under the new root) for its branches, beside the grid's last LR
    fresh = tmp_path / "fresh" / "runs"
    state = lr_grid.State(fresh, archive)
    assert state.loss(lr_grid.Run("dense-l1", "baseline", part, 0.001, 0.01, 0)) == 5.0
    assert state.loss(lr_grid.Run("dense-l1", "baseline", part, 0.003, 0.01, 0)) == lr_grid.FAILED
    assert (state.where(lr_grid.Run("dense-l1", "baseline", part, 0.001, 0.01, 0))
            == archive / name("0.001", 0))
    for _ in range(2):
        assert lr_grid.next_run(fresh, os.getpid(), ["grow"], archive) == 0
    # the branches wait on their trunk
    assert lr_grid.next_run(fresh, os.getpid(), ["grow"], archive) == 3
    printed = {line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert printed == {str(fresh / name("0.001", 0)), str(fresh / name("0.01", 0))}
    finish(fresh, name("0.001", 0), 5.0)
    (Path(f"{fresh}_logs") / f"{name('0.001', 0)}.claim").unlink()
    assert lr_grid.next_run(fresh, os.getpid(), ["grow"], archive) == 0
    assert capsys.readouterr().out.split()[1] == str(fresh / name("0.001", 0, tpp="2.5"))
    # a grid shorter than the trunks has no trunks to branch
    short = replace(part, grid_tpp=2.5)
    finish(fresh, name("0.003", 0, tpp="2.5"), 4.0)
    assert lr_grid.Arm(short, "dense-l1", "baseline", lr_grid.State(fresh)).check_runs() == []

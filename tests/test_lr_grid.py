"""scripts/lr_grid.py, the queue of issue 47's LR grids: what it asks to train next for a given state of
finished runs, written here as run directories that hold only what the queue reads (config.yaml's
train.steps, the last checkpoint's COMPLETE marker, metrics.jsonl's last val_loss)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lr_grid.py"
spec = importlib.util.spec_from_file_location("lr_grid", SCRIPT)
lr_grid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lr_grid)

PART = lr_grid.Part("adamw", (0.001, 0.003, 0.01, 0.03), seeds=(0, 1), tiebreak=2, scale_lr=0.01, final=(0, 1, 2),
                    rungs=("dense-l1",), scales=("baseline",))


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
    assert needed(root) == sorted(name(lr, s) for lr in ("0.001", "0.003", "0.01", "0.03") for s in (0, 1))
    losses = {"0.001": (5.0, 5.0), "0.003": (4.8, 4.9), "0.01": (4.6, 4.7), "0.03": (4.5, 4.6)}
    for lr, pair in losses.items():
        for seed, loss in enumerate(pair):
            finish(root, name(lr, seed), loss)
    # the best (0.03) is at the grid's edge: the next LR up
    assert needed(root) == [name("0.1", 0), name("0.1", 1)]
    finish(root, name("0.1", 0), 4.56)
    finish(root, name("0.1", 1), 4.62)
    # 0.03 (4.55) and 0.1 (4.59) are closer than either's seed range (0.1, 0.06): a third seed at both
    assert needed(root) == [name("0.03", 2), name("0.1", 2)]
    finish(root, name("0.03", 2), 4.9)  # 0.03 over three seeds: 4.667
    finish(root, name("0.1", 2), 4.5)  # 0.1: 4.56, the better
    assert needed(root) == sorted(name("0.1", s, slr) for s in (0, 1, 2) for slr in ("0.003", "0.03"))
    for s in (0, 1, 2):
        finish(root, name("0.1", s, "0.003"), 4.4)
        finish(root, name("0.1", s, "0.03"), 4.7)
    # the pick (lr 0.1, scale_lr 0.003) has all three seeds as trunks: their branches next
    assert needed(root) == sorted(name("0.1", s, "0.003", tpp) for s in (0, 1, 2) for tpp in ("2.5", "5"))


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
    assert lr_grid.next_run(root, pid, ["test"]) == 3  # the one run left is claimed by a live worker
    assert lr_grid.done(root, str(root / name("0.03", 1)), 1) == 1  # an error stops the worker
    assert not (logs / f"{name('0.03', 1)}.claim").exists()
    finish(root, name("0.03", 1), 7.0)
    # best 0.01 inside the grid (0.03 failed on one seed: the worst point); 0.01 and 0.003 are 0.1 apart,
    # more than either's seed range: no third seed; the sites' LR next
    assert needed(root) == sorted(name("0.01", s, slr) for s in (0, 1) for slr in ("0.003", "0.03"))


def test_a_check_starts_around_another_parts_pick_and_muon_waits_for_every_other_part(root, monkeypatch):
    check = lr_grid.Part("adamw", (), seeds=(0,), scale_lr=0.01, sites=False, rungs=("dense-l4",),
                         scales=("baseline",), around=("test", "dense-l1"))
    muon = lr_grid.Part("muon", (0.001, 0.003, 0.01), seeds=(0,), rungs=("dense-l1",), scales=("baseline",))
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
    l4 = [f"dense-l4-baseline-adamw-lr{lr}-scale_lr0.01-tpp10-s0" for lr in ("0.001", "0.003", "0.01")]
    assert sorted(r.name for r in arm.needed()) == l4
    # the queue: dense-l1's Muon grid is the smallest rung, yet comes after the dense-l4 check
    order = []
    logs = Path(f"{root}_logs")
    while lr_grid.next_run(root, os.getpid(), ["muon_test", "test", "check"]) == 0:
        (claim,) = logs.glob("*.claim")
        claim.unlink()
        order.append(claim.name[: -len(".claim")])
        finish(root, order[-1], 4.0 if "-lr0.003-" in order[-1] else 4.5)  # 3e-3 stays the best: no widening
    assert set(order[-3:]) == {f"dense-l1-baseline-muon-lr{lr}-tpp10-s0" for lr in ("0.001", "0.003", "0.01")}
    assert set(order[-6:-3]) == set(l4)
    # the transfer table carries the check's rung in its source part's row: 3e-3 on both, no step
    assert lr_grid.transfer_table(["test", "check"], lr_grid.State(root)).splitlines() == [
        "| arm | part | dense-l1 | dense-l4 | steps per rung | smallest to largest |",
        "|---|---|---:|---:|---:|---:|",
        "| baseline adamw | test | 0.003 | 0.003 | +0 | +0 |"]

"""WSD cooldown branches (branch_from): a branch to the trunk's own end is the trunk's computation,
a branch to an earlier end decays over its own span, and its run directory reads like a run trained
from scratch. References: the trunk's own metrics (a second code path: one uninterrupted run) and
the closed form of the 1-sqrt decay."""

import math
from pathlib import Path

import pytest
import yaml

from scalevec_analysis import efficiency_series, group_runs, load_run_dir
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run.branch import shared_steps
from scalevec_train.train import run
from tests.support.helpers import make_config
from tests.support.launch import curve, records
from tests.support.presets import SMALL_MODEL

TINY = [*SMALL_MODEL, "model.ffn_dim=176",
        "train.seq_len=64", "train.global_batch=8", "train.micro_batch=4", "train.eval_batches=2",
        "train.log_every=1", "train.eval_every=5", "schedule=wsd", "schedule.warmup_steps=2",
        "schedule.decay_fraction=0.5", "optim.lr=1e-2"]
STEPS = 20  # the trunk decays over its last 10 steps




@pytest.fixture(scope="module")
def trunk(data_overrides, tmp_path_factory) -> tuple[list[str], Path]:
    common = [*data_overrides, *TINY]
    trunk_dir = tmp_path_factory.mktemp("branch") / "trunk"
    run(make_config(*common, f"train.steps={STEPS}", "checkpoint.every=2",
                    "checkpoint.keep_last=20", f"run_dir={trunk_dir}"))
    return common, trunk_dir


def test_a_branch_to_the_trunks_end_reproduces_the_trunk(trunk, tmp_path):
    common, trunk_dir = trunk
    branch = run(make_config(*common, f"train.steps={STEPS}",
                             f"branch_from={trunk_dir}/checkpoints/step_000006",
                             f"run_dir={tmp_path / 'to20'}"))
    expected, got = records(trunk_dir), records(branch)
    # its record: the trunk's history up to the branch point, then the checkpoint it came from
    assert (got[:len([r for r in expected if r["step"] <= 6])]
            == [r for r in expected if r["step"] <= 6])
    assert {"step": 6, "branch_from": f"{trunk_dir}/checkpoints/step_000006"} in got
    assert yaml.safe_load((branch / "config.yaml").read_text())["branch_from"].endswith(
            "step_000006")
    # steps 7-20, the WSD decay included, are the same computation
    for key in ("loss", "lr", "grad_norm", "val_loss"):
        assert curve(branch, key) == curve(trunk_dir, key), key
    # from the run directory: its newest checkpoint before the end, as the whole trunk shares this
    # schedule
    again = run(make_config(*common, f"train.steps={STEPS}", f"branch_from={trunk_dir}",
                            f"run_dir={tmp_path / 'newest'}"))
    assert {"step": 18, "branch_from": f"{trunk_dir}/checkpoints/step_000018"} in records(again)


def test_a_branch_with_an_earlier_end_decays_over_its_own_span(trunk, tmp_path):
    common, trunk_dir = trunk
    branch = run(make_config(*common, "train.steps=10", f"branch_from={trunk_dir}",
                             f"run_dir={tmp_path / 'to10'}"))
    # its 1-sqrt decay runs over step indices 5-9 (the last half of 10) and first lowers the LR at
    # index 6, so the newest trunk checkpoint it shares every earlier LR with is step 6
    assert {"step": 6, "branch_from": f"{trunk_dir}/checkpoints/step_000006"} in records(branch)
    lr, trunk_loss, loss = curve(branch, "lr"), curve(trunk_dir, "loss"), curve(branch, "loss")
    assert sorted(lr)[-4:] == [7, 8, 9, 10]
    for step in (7, 8, 9, 10):  # logged step s took the LR of index s - 1
        assert lr[step] == pytest.approx(1e-2 * (1 - math.sqrt((step - 1 - 5) / 5)),
                                         rel=1e-12), step
    assert lr[10] < 0.11 * 1e-2 < curve(trunk_dir, "lr")[10]
    # the trunk's weights until the first decayed update has been taken (index 6, logged as step 7)
    assert loss[7] == trunk_loss[7]
    assert all(loss[s] != trunk_loss[s] for s in (8, 9, 10))
    # a finished branch run again with resume=auto continues from its own checkpoint: nothing new
    before = (branch / "metrics.jsonl").read_text()
    run(make_config(*common, "train.steps=10", f"branch_from={trunk_dir}", f"run_dir={branch}",
                    "resume=auto"))
    assert (branch / "metrics.jsonl").read_text().startswith(before)


def test_branches_read_as_runs_of_their_own_length(trunk, tmp_path):
    common, trunk_dir = trunk
    short = run(make_config(*common, "train.steps=10", f"branch_from={trunk_dir}",
                            f"run_dir={tmp_path / 'b10'}"))
    full = run(make_config(*common, f"train.steps={STEPS}", f"branch_from={trunk_dir}",
                           f"run_dir={tmp_path / 'b20'}"))
    groups = group_runs([load_run_dir(d) for d in (trunk_dir, short, full)])
    assert sorted(len(g.runs) for g in groups) == [1, 2]  # the full-length branch joins its trunk
    assert {g.label for g in groups} == {"train.steps=10", "train.steps=20"}
    curve = load_run_dir(short).records
    assert curve[0]["step"] == 0 and "val_loss" in curve[0] and curve[-1]["step"] == 10
    # compute efficiency reads a trunk and its branch as two budgets of one rung, the reference's
    # curves there
    (series,) = efficiency_series([load_run_dir(d) for d in (trunk_dir, short)])
    assert [p.label for p in series.points] == ["train.steps=10", "train.steps=20"]
    assert series.points[0].rung == series.points[1].rung


@pytest.mark.parametrize("overrides,message", [
    (["train.steps=10", "branch_from={trunk}/checkpoints/step_000008"],
     r"branch_from: no checkpoint of .* \(steps 8\) is at or before step 6"),
    (["schedule=cosine", "branch_from={trunk}/checkpoints/step_000010"],
     r"is at or before step 3: after it this branch ends or its learning rates leave"),
    (["train.global_batch=16", "branch_from={trunk}"],
     "train.global_batch: this branch takes 1,024 tokens per step"),
    (["branch_from={trunk}", "run_dir={trunk}", "resume=auto"],
     "run_dir: .* is the trunk's own run directory"),
    (["branch_from={trunk}/checkpoints/step_000004", "run_dir={trunk}"],
     "run_dir: .* is the trunk's own run"),
    (["branch_from={trunk}/checkpoints"], "is neither a run directory nor a complete checkpoint"),
])
def test_a_branch_that_would_not_continue_its_trunk_is_refused(trunk, tmp_path, overrides, message):
    common, trunk_dir = trunk
    overrides = [o.format(trunk=trunk_dir) for o in overrides]
    if not any(o.startswith("run_dir=") for o in overrides):
        overrides.append(f"run_dir={tmp_path / 'refused'}")
    with pytest.raises(ScalevecError, match=message):
        run(make_config(*common, f"train.steps={STEPS}", *overrides))
    assert not (tmp_path / "refused").exists()


def test_branch_from_and_another_start_are_refused():
    with pytest.raises(ScalevecError, match="branch_from: and init_from both say where the "
                                            "run starts"):
        make_config("branch_from=runs/x", "init_from=hf/llama")
    with pytest.raises(ScalevecError, match="branch_from: and resume both say where the "
                                            "run starts"):
        make_config("branch_from=runs/x", "resume=runs/x/checkpoints/step_000002")


@pytest.mark.parametrize("model", [f"{family}-l{rung}" for family in ("dense", "moe")
                                   for rung in (4, 6, 8, 12, 16, 20)])
def test_gpu_ladder_branches_start_at_their_budget_checkpoints(model):
    """docs/guides/experiments.md's GPU ladder: WSD trunks of 100 tokens per parameter saving every
    20 give branches to 25 and 50 that start from the 20 and 40 checkpoints, so that each costs only
    its decay."""
    wsd = [f"model={model}", "schedule=wsd"]
    trunk = make_config(*wsd, "train.tokens_per_param=100", "checkpoint.every_tokens_per_param=20")
    every = trunk.checkpoint.every
    for budget, checkpoints in ((25, 1), (50, 2)):
        branch = make_config(*wsd, f"train.tokens_per_param={budget}")
        # its LR is still the peak there
        decay_start = branch.train.steps - round(0.2 * branch.train.steps)
        assert shared_steps(trunk, branch, trunk.train.steps) == decay_start + 1
        assert (max(k for k in range(every, trunk.train.steps + 1, every) if k <= decay_start + 1)
                == checkpoints * every)

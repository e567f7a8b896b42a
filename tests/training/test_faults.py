"""Kills at any moment, and checkpoint writes that fail, with real processes
(docs/guides/reliability.md).

Kills: a 2-rank run is stopped at fault points (scalevec_train/infra/faults.py) chosen to land in
each phase of a step and of a checkpoint, synchronous and asynchronous (before, during and after the
shard files, the train state, the COMPLETE marker, the rename and the deletion of older
checkpoints), and SIGKILLed there: one rank (the other then fails in its next collective with it) or
every rank at once. After each kill every checkpoint that resume=auto may pick is whole, the newest
is the one that point allows, and the next attempt resumes with resume=auto. The run then ends with
parameters, optimizer state, data position and guard counters bit-identical to the uninterrupted
2-rank run. The attempts are children forked from the workers of one torchrun launch
(tests/support/attempts.py), about 0.6 s of CPU per rank each, where a launch costs seconds. The
test fails if a checkpoint is marked complete before its files, or if its data position is not that
of its step (docs/guides/reliability.md says how that was checked). dev/kill_soak.py kills at random
moments for longer.

Failed writes: a full disk or an I/O error while a checkpoint is written stops the run on every rank
with exit code 4 and one line naming the rank and the error; the previous complete checkpoint is
untouched, the partial folder is gone, and resume=auto continues from that checkpoint to the
uninterrupted run. On 1 rank (in this process) and 2 ranks, synchronous and asynchronous.

The loss faults (step.loss: nan, infgrad) on their own, and malformed entries; the runs they make:
test_reliability.py.
"""

import hashlib
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.infra.errors import CheckpointWriteError, ScalevecError
from scalevec_train.infra.faults import FAULT_AT_ENV, check_faults, loss_fault
from scalevec_train.infra.lock import DirLock
from scalevec_train.train import run
from tests.support.helpers import make_config
from tests.support.launch import _state, assert_same_checkpoint, newest_whole, records
from tests.support.presets import TINY_MODEL

STEPS, EVERY = 6, 2
# 2 ranks of one sequence each per step; keep_last=1: every save deletes the one before.
RUN = [*TINY_MODEL, "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
       "train.eval_batches=1", "train.eval_every=0", "schedule=constant", "schedule.warmup_steps=1",
       "device=cpu", "train.log_every=1", f"train.steps={STEPS}", f"checkpoint.every={EVERY}",
       "checkpoint.keep_last=1"]
ASYNC = "checkpoint.async_save=true"

# (fault point, kill one rank or all, the newest complete checkpoint after the kill)
SYNC_KILLS = [
    ("step.start:1@0", "all", None),
    ("save.files:2@1", "one", None),  # rank 1's shard half written
    ("save.agree:2@0", "all", None),  # every shard written (rank 1 waits for rank 0)
    ("save.marker:2@0", "one", None),  # train_state.json written, no marker
    ("save.retain:2@0", "all", 2),  # renamed into place
    ("step.optimizer:3@1", "one", 2),
    ("step.record:3@0", "all", 2),
    ("save.folder:4@0", "one", 2),
    ("save.files:4@0", "all", 2),
    ("save.state:4@0", "one", 2),
    ("save.rename:4@0", "all", 2),  # marked, not renamed
    ("save.delete:4@0", "one", 4),  # step 2 renamed out of sight, not deleted
    ("step.checkpoint:5@1", "all", 4),
    ("save.files:6@1", "one", 4),
]
# An async save of step s is written while steps s+1.. train, and completed at the next save.
ASYNC_KILLS = [
    ("save.files:2@0", "all", None),  # in rank 0's writing thread
    ("step.start:3@1", "one", None),  # the save of step 2 in flight or written, not complete
    ("save.agree:2@1", "all", None),  # at step 4's save
    ("save.marker:2@0", "one", None),
    ("save.retain:2@0", "all", 2),
    ("save.files:4@1", "one", 2),
    ("step.record:5@0", "all", 2),
    ("save.rename:4@0", "one", 2),  # at step 6's save
    ("save.delete:4@0", "all", 4),
    ("save.marker:6@0", "one", 4),  # the last save, completed at the end of the run
]


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    prepare_data(make_config(*data_overrides).data)  # here, once, rather than by 2 ranks at a time
    return [*data_overrides, *RUN]


@pytest.fixture(scope="module")
def reference(common, attempts, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run, every checkpoint kept."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert attempts.run([*common, "checkpoint.keep_last=10", f"run_dir={run_dir}"]) == [0, 0]
    return run_dir


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kills_at_every_phase_of_steps_and_saves_lose_nothing(
        mode, common, attempts, reference, tmp_path):
    run_dir = tmp_path / "killed"
    overrides = [*common, *([ASYNC] if mode == "async" else []), f"run_dir={run_dir}",
                 "resume=auto"]
    for fault, kill, newest in SYNC_KILLS if mode == "sync" else ASYNC_KILLS:
        codes = attempts.run(overrides, fault, kill)
        assert -9 in codes and 0 not in codes, (fault, codes)
        assert newest_whole(run_dir) == newest, fault
        # the run directory's lock names the dead rank 0 (unless rank 0 outlived a killed rank 1 and
        # released it on its way out): the next attempt takes it over at once
        rank0 = attempts.pids_of(attempts.count - 1)[0]
        assert (lock_holder(run_dir) == rank0 if codes[0] == -9
                else lock_holder(run_dir) is None), (fault, codes)
    assert attempts.run(overrides) == [0, 0]
    assert newest_whole(run_dir) == STEPS
    assert (sorted(p.name for p in checkpoint_files.checkpoint_root(run_dir).iterdir())
            == [f"step_{STEPS:06d}"])
    assert_same_checkpoint(checkpoint_files.step_dir(run_dir, STEPS),
                           checkpoint_files.step_dir(reference, STEPS), tmp_path)


def lock_holder(run_dir: Path) -> int | None:
    text = (run_dir / ".lock").read_text()
    return json.loads(text)["pid"] if text else None


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_live_two_rank_run_holds_its_run_dir_and_a_killed_one_is_continued_at_once(
        common, attempts, reference, tmp_path):
    """While a 2-rank run lives (rank 0 stopped mid-run, rank 1 waiting for it), a second launch and
    a branch into its run_dir refuse, naming rank 0, and write nothing; a run in another run_dir
    sharing the data cache trains meanwhile. Once every rank is killed, resume=auto continues at
    once to the end of the uninterrupted run, bit for bit."""
    run_dir = tmp_path / "held"
    overrides = [*common, f"run_dir={run_dir}", "resume=auto"]
    pids = attempts.start(overrides, "step.start:3@0")
    try:
        attempts.started.wait_until(lambda: _state(pids[0]) == "T", "rank 0 stopped at step 3")
        before = tree_digest(run_dir)
        for second in ([], [f"branch_from={reference}", "resume=none"]):
            with pytest.raises(ScalevecError,
                               match=f"run_dir: {run_dir} is in use by a live run \\(host .*, pid "
                               f"{pids[0]}, started .* UTC; its lock {run_dir}/.lock\\)") as info:
                run(make_config(*overrides, *second))
            assert " Fix: wait for that run to end or stop it" in str(info.value)
            assert tree_digest(run_dir) == before
        other = run(make_config(*common, "train.steps=2", f"run_dir={tmp_path / 'other'}"))
        assert newest_whole(other) == 2
    finally:  # the stopped run ends whatever happened: the attempts' workers wait for it
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    assert attempts.wait() == [-9, -9]
    assert attempts.run(overrides) == [0, 0]
    assert_same_checkpoint(checkpoint_files.step_dir(run_dir, STEPS),
                           checkpoint_files.step_dir(reference, STEPS), tmp_path)


def test_a_second_launch_on_two_ranks_refuses_on_both_naming_the_holder(common, attempts, tmp_path):
    run_dir = tmp_path / "held"
    with DirLock(run_dir) as lock:  # held by this process, as by a run
        lock.acquire()
        assert attempts.run([*common, f"run_dir={run_dir}"]) == [2, 2]
    errors = [line for line in attempts.started.output().splitlines()
              if line.startswith(("[rank 0] error:", "[rank 1] error:"))
              and f"pid {os.getpid()}," in line]
    assert len(errors) == 2 and errors[0][9:] == errors[1][9:], errors
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


# Failed writes.

def assert_stopped_at_a_failed_write(run_dir: Path, reference: Path, scratch: Path) -> None:
    """Step 4's checkpoint failed: step 2's is the newest, whole and the reference's; nothing else
    is left."""
    assert newest_whole(run_dir) == 2
    assert (sorted(p.name for p in checkpoint_files.checkpoint_root(run_dir).iterdir())
            == ["step_000002"])
    assert_same_checkpoint(checkpoint_files.step_dir(run_dir, 2),
                           checkpoint_files.step_dir(reference, 2), scratch)


@pytest.mark.parametrize("fault, mode, message", [
    ("save.files:4@1=nospace", "sync", "rank 1: OSError: [Errno 28] No space left on device"),
    # found at step 6
    ("save.files:4@0=ioerror", "async", "rank 0: OSError: [Errno 5] Input/output error"),
    ("save.marker:4@0=nospace", "sync", "rank 0: OSError: [Errno 28] No space left on device"),
])
def test_a_failed_write_on_two_ranks_stops_both_and_keeps_the_previous_checkpoint(
        fault, mode, message, common, attempts, reference, tmp_path):
    run_dir = tmp_path / "failed"
    overrides = [*common, *([ASYNC] if mode == "async" else []), f"run_dir={run_dir}",
                 "resume=auto"]
    assert attempts.run(overrides, fault) == [4, 4]
    errors = [line for line in attempts.started.output().splitlines()
              if line.startswith(("[rank 0] error:", "[rank 1] error:")) and str(run_dir) in line]
    assert len(errors) == 2, errors  # one line per rank, the same
    assert errors[0].split("error: ", 1)[1] == errors[1].split("error: ", 1)[1]
    assert f"{checkpoint_files.step_dir(run_dir, 4)}: could not be written ({message}" in errors[0]
    assert f"{checkpoint_files.step_dir(run_dir, 2)} is the newest complete checkpoint" in errors[0]
    assert_stopped_at_a_failed_write(run_dir, reference, tmp_path)

    assert attempts.run(overrides) == [0, 0]
    assert_same_checkpoint(checkpoint_files.step_dir(run_dir, STEPS),
                           checkpoint_files.step_dir(reference, STEPS), tmp_path)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_write_on_one_process_stops_it_and_keeps_the_previous_checkpoint(
        mode, common, tmp_path, monkeypatch):
    overrides = [*common, *([ASYNC] if mode == "async" else []), f"run_dir={tmp_path / 'failed'}",
                 "resume=auto"]
    monkeypatch.setenv(FAULT_AT_ENV, "save.files:4=nospace")
    with pytest.raises(CheckpointWriteError,
                       match=r"rank 0: OSError: \[Errno 28\] No space left on device"):
        run(make_config(*overrides))
    run_dir = tmp_path / "failed"
    assert newest_whole(run_dir) == 2
    assert (sorted(p.name for p in checkpoint_files.checkpoint_root(run_dir).iterdir())
            == ["step_000002"])

    monkeypatch.delenv(FAULT_AT_ENV)
    run(make_config(*overrides))
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    # resumed after step 2
    assert steps == [1, 2, 3, 4, *([5, 6] if mode == "async" else []), 3, 4, 5, 6]
    assert newest_whole(run_dir) == STEPS


def test_loss_faults_hit_the_steps_and_ranks_their_entries_name_and_a_malformed_entry_is_named(
        monkeypatch):
    """step.loss's actions on a loss 3x (this process is rank 0): nan makes it NaN; infgrad keeps it
    finite and makes its gradient infinite; an entry for rank 1 does nothing here. Against written
    values."""
    monkeypatch.setenv(FAULT_AT_ENV, "step.loss:2=nan, step.loss:3@1=nan,step.loss:4@0=infgrad")
    check_faults()

    def loss_and_grad(step: int) -> tuple[float, float]:
        x = torch.tensor(2.0, requires_grad=True)
        loss = loss_fault(x * 3.0, step)
        loss.backward()
        return loss.item(), x.grad.item()

    assert loss_and_grad(1) == (6.0, 3.0)
    assert all(math.isnan(v) for v in loss_and_grad(2))
    assert loss_and_grad(3) == (6.0, 3.0)
    assert loss_and_grad(4) == (6.0, math.inf)

    for entry in ["x", "step.loss:3=inf", "step.loss:three=nan", "step.loss:3@one=infgrad",
                  "step.start:3=nan", "save.files:4=infgrad", "loss:3=nan"]:
        monkeypatch.setenv(FAULT_AT_ENV, f"step.loss:2=nan,{entry}")
        with pytest.raises(ScalevecError) as info:
            check_faults()
        message = str(info.value)
        assert message.startswith(f"{FAULT_AT_ENV}: {entry!r} is not "
                                  "<point>:<step>[@<rank>][=<action>] with a point of step.start, "
                                  "step.loss,"), message
        assert ("nan and infgrad at step.loss only" in message and " Fix: " in message
                and "\n" not in message)

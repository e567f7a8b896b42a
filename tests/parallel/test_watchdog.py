"""Hangs on real gloo ranks: a rank stopped (SIGSTOP at a fault point,
scalevec_train/infra/faults.py) in the forward, in the optimizer step, in a checkpoint save and in
the data loader, or blocked there alive, is found by the other rank's hang watchdog
(parallel/watchdog.py) within distributed.hang_s: the run exits with code 5 and one line naming the
rank that did not arrive and the phase, every running rank writes its stacks to run_dir/hang/, the
stopped rank is left as it was (nothing waited for it to be killed), and resume=auto then ends
bit-identical to the uninterrupted run. A rank that is slow (it sleeps longer than a step, every
step) trips nothing. SIGTERM during a hang ends the waiting rank with its own line, without waiting
for the watchdog's floor. With the watchdog off, a collective times out after distributed.timeout_s
once the first step has finished.

The runs are attempts of one torchrun launch (the `attempts` fixture, tests/conftest.py), as in
tests/training/test_faults.py. The bound is a floor of 3 s here: generous for the tiny steps on busy
cores, and what each hang costs the test.
"""

import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import FAULT_AT_ENV, check_faults
from scalevec_train.infra.progress import Progress
from scalevec_train.parallel import process_group
from scalevec_train.parallel.watchdog import PULSE_S, Watchdog, culprits
from tests.support.helpers import make_config
from tests.support.launch import Attempts, _state, assert_same_checkpoint
from tests.support.presets import TINY_MODEL

STEPS, EVERY = 6, 2
RUN = [*TINY_MODEL, "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
       "train.eval_batches=1", "train.eval_every=0", "schedule=constant", "schedule.warmup_steps=1",
       "device=cpu", "train.log_every=1", f"train.steps={STEPS}", f"checkpoint.every={EVERY}",
       "checkpoint.keep_last=1"]
FLOOR = "distributed.hang_s=3"


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    prepare_data(make_config(*data_overrides).data)  # here, once, rather than by 2 ranks at a time
    return [*data_overrides, *RUN]


@pytest.fixture(scope="module")
def reference(common, attempts, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert attempts.run([*common, f"run_dir={run_dir}"]) == [0, 0]
    return run_dir


def hung(attempts: Attempts, overrides: list[str], fault: str, stopped: int | None,
         sigterm: bool = False) -> list[int]:
    """One attempt with `fault`, which stops rank `stopped` (None: none stops); the other ranks must
    end by themselves, the stopped one still stopped then (it is killed after). `sigterm`: once the
    rank has stopped, the others get SIGTERM. Returns each rank's exit code (negative: the
    signal)."""
    pids = attempts.start(overrides, fault)
    if stopped is not None:
        attempts.started.wait_until(lambda: _state(pids[stopped]) == "T",
                                    f"rank {stopped} stopped at {fault}")
        if sigterm:
            for r, pid in enumerate(pids):
                if r != stopped:
                    os.kill(pid, signal.SIGTERM)
    running = [r for r in range(attempts.nproc) if r != stopped]
    attempts.started.wait_until(lambda: all(attempts.exits()[r] is not None for r in running),
                                f"the end of the ranks that waited for rank {stopped}")
    if stopped is not None:
        assert _state(pids[stopped]) == "T", fault
        os.kill(pids[stopped], signal.SIGKILL)
    return attempts.wait()


def error_lines(attempts: Attempts, run_dir: Path) -> list[str]:
    return [line for line in attempts.started.output().splitlines()
            if " error: " in line and str(run_dir) in line]


# (fault, the rank it stops, where that rank stopped, where the other waits, a frame of the other's
# stacks)
STOPS = [
    ("step.loss:3@1", 1, "forward/backward of step 3", "forward/backward of step 3",
     "in train_step"),
    ("step.optimizer:3@1", 1, "optimizer of step 3", "optimizer of step 3", "in clip_grad_norm"),
    ("save.files:4@0", 0, "checkpoint of step 4", "checkpoint of step 4", "in _save"),
    ("data.batch:3@1", 1, "data of step 3", "forward/backward of step 3", "in train_step"),
]


@pytest.mark.parametrize("fault, stopped, where, waits, frame", STOPS)
def test_a_stopped_rank_is_named_by_the_others_which_end_the_run_and_it_resumes(
        fault, stopped, where, waits, frame, common, attempts, reference, tmp_path):
    run_dir = tmp_path / "hung"
    overrides = [*common, FLOOR, f"run_dir={run_dir}", "resume=auto"]
    other = 1 - stopped
    codes = hung(attempts, overrides, fault, stopped)
    assert codes[other] == 5 and codes[stopped] == -signal.SIGKILL, codes
    errors = error_lines(attempts, run_dir)
    assert len(errors) == 1, errors
    step = where.rsplit(" ", 1)[1]
    assert errors[0].startswith(f"[rank {other}] error: training (step {step}): no progress on "
                                f"rank {other} for ")
    assert (f"Rank {stopped} shows no sign of life (stopped, frozen, or its host lost; last seen "
            f"in {where}); running: rank {other} in {waits} (") in errors[0], errors[0]
    assert "the larger of distributed.hang_s=3 and 5x the slowest recent step" in errors[0]
    assert (f"The Python stacks of every rank still running are in {run_dir}/hang/rank<r>.txt. "
            "Fix: ") in errors[0]
    stacks = (run_dir / "hang" / f"rank{other}.txt").read_text()
    assert stacks.startswith(errors[0].split(" error: ", 1)[1])
    # every thread's, the main one's too
    assert "Thread 0x" in stacks and frame in stacks and "in _hang" in stacks
    assert not (run_dir / "hang" / f"rank{stopped}.txt").exists()

    assert attempts.run(overrides) == [0, 0]
    assert_same_checkpoint(checkpoint_files.step_dir(run_dir, STEPS),
                           checkpoint_files.step_dir(reference, STEPS), tmp_path)


def test_a_rank_blocked_alive_in_the_loader_did_not_arrive_and_both_dump_their_stacks(
        common, attempts, tmp_path):
    """Its main thread blocked (a stuck read), its watchdog alive: the rank behind the other is
    named, and its own stacks show where it is stuck. Both ranks end (a resume after a hang: the
    stopped ranks')."""
    run_dir = tmp_path / "blocked"
    overrides = [*common, FLOOR, f"run_dir={run_dir}"]
    assert hung(attempts, overrides, "data.batch:3@1=hang", None) == [5, 5]
    errors = error_lines(attempts, run_dir)
    # one a rank, or one rank's: the other may follow the flag first
    assert 1 <= len(errors) <= 2, errors
    for line in errors:
        assert ("Rank 1 did not arrive: rank 1 in data of step 3 (" in line
                and "), while the others wait: rank 0 in forward/backward "
                    "of step 3 (" in line), line
    stacks = {r: (run_dir / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "in next_batch" in stacks[1] and "in wait" in stacks[1]
    assert "in next_batch" not in stacks[0] and "in train_step" in stacks[0]


def test_a_slow_rank_is_not_a_hang(common, attempts, reference, tmp_path):
    """Rank 1 sleeps 1 s in each of the first 3 steps, longer than a step and than the floor (0.5
    s): the bound follows the measured steps, and the run ends as the uninterrupted one."""
    run_dir = tmp_path / "slow"
    slow = ",".join(f"step.start:{s}@1=sleep" for s in range(1, 4))
    assert attempts.run([*common, "distributed.hang_s=0.5", f"run_dir={run_dir}"], slow) == [0, 0]
    assert not error_lines(attempts, run_dir) and not (run_dir / "hang").exists()
    assert_same_checkpoint(checkpoint_files.step_dir(run_dir, STEPS),
                           checkpoint_files.step_dir(reference, STEPS), tmp_path)


def test_sigterm_during_a_hang_ends_the_waiting_rank_with_its_line(common, attempts, tmp_path):
    """Far below the floor (100 s): the waiting rank's main thread sits in a collective, its handler
    of SIGTERM unrun; the watchdog sees the signal and ends the rank after the grace (2 s here)."""
    run_dir = tmp_path / "sigterm"
    overrides = [*common, "distributed.hang_s=100", "distributed.sigterm_grace_s=2",
                 f"run_dir={run_dir}", "resume=auto"]
    assert hung(attempts, overrides, "step.start:3@1", 1, sigterm=True) == [5, -signal.SIGKILL]
    errors = error_lines(attempts, run_dir)
    assert len(errors) == 1, errors
    assert errors[0].startswith("[rank 0] error: training (step 3): SIGTERM while hung: no "
                                "progress on rank 0 for ")
    assert ("after a SIGTERM, the larger of distributed.sigterm_grace_s=2 and 3x the slowest "
            "recent step") in errors[0]
    assert ("Rank 1 shows no sign of life (stopped, frozen, or its host lost; last seen in data of "
            "step 3)") in errors[0]
    assert errors[0].endswith(" Fix: continue with resume=auto: the steps since the newest "
                              "complete checkpoint are lost.")
    assert (run_dir / "hang" / "rank0.txt").is_file()


def test_without_the_watchdog_a_collective_times_out_after_the_first_step(
        common, attempts, tmp_path):
    run_dir = tmp_path / "timeout"
    overrides = [*common, "distributed.hang_s=0", "distributed.timeout_s=5", f"run_dir={run_dir}"]
    codes = hung(attempts, overrides, "step.optimizer:3@1", 1)
    assert codes == [1, -signal.SIGKILL]
    assert "Timed out waiting 5000ms" in attempts.started.output()
    assert not (run_dir / "hang").exists()


def _fail_in_a_collective(store: str, run_dir: str, flagged: bool, follow: bool) -> None:
    """A rank of one whose main thread fails as a collective does when its peer has exited;
    `flagged`: that peer flagged a hang first; `follow`: the main thread reaches follow() (else it
    is still handling the error, as in the fit's other callbacks, when the watchdog's next pulse
    reads the flag)."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    watchdog = Watchdog(Progress(), 5.0, Path(run_dir), 10.0).start()
    if flagged:
        watchdog.store.set(f"{watchdog.prefix}hang", "training (step 3): the hang rank 1 found.")
    try:
        raise RuntimeError("Connection closed by peer")
    except RuntimeError as e:
        if follow:
            watchdog.follow(e)
        else:
            time.sleep(4 * PULSE_S)
    sys.exit(7)  # nothing flagged: the error goes on as it was


@pytest.mark.parametrize("flagged,follow", [(True, True), (True, False), (False, True)])
def test_a_rank_whose_collective_broke_after_a_hang_was_flagged_ends_as_the_hang(
        flagged, follow, tmp_path):
    """The rank that found a hang exits; the collective another rank waits in then fails at once,
    before that rank's watchdog reads the flag: it still ends with exit 5 and the hang's line, the
    failure's traceback (where it waited) in its stacks, whether its main thread or its watchdog
    gets there first.
    Without a flag the failure is left to the main thread."""
    process = multiprocessing.get_context("spawn").Process(
        target=_fail_in_a_collective,
        args=(str(tmp_path / "store"), str(tmp_path), flagged, follow))
    process.start()
    process.join()
    assert process.exitcode == (5 if flagged else 7)
    if flagged:
        stacks = (tmp_path / "hang" / "rank0.txt").read_text()
        assert stacks.startswith("training (step 3): the hang rank 1 found. (rank 0 followed the "
                                 "rank that found the hang)\n\n")
        assert ("in _fail_in_a_collective" in stacks
                and "RuntimeError: Connection closed by peer" in stacks)
        assert "Current thread 0x" in stacks
    else:
        assert not (tmp_path / "hang").exists()


def test_set_timeout_bounds_every_group_and_the_groups_made_after(tmp_path):
    """On a group of one (in this process): the world group, a group made before and one made after
    by new_group (as the asynchronous checkpoint's is: torch's own new_group would give it 30
    minutes) all time out after set_timeout's seconds. The timeout read is the one the backend waits
    by (test_without_the_watchdog_a_collective_times_out_after_the_first_step sees it on 2
    ranks)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        before = dist.new_group(backend="gloo")
        process_group.set_timeout(7)
        groups = [dist.group.WORLD, before, process_group.new_group("gloo")]
        assert ([g._get_backend(torch.device("cpu")).options._timeout for g in groups]
                == [timedelta(seconds=7)] * 3)
    finally:
        process_group.shutdown()


# The parts, without processes.

def test_progress_measures_spans_by_kind_and_a_phase_returns_to_the_one_before(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 4.0, 4.5, 10.0, 11.0, 13.0])
    monkeypatch.setattr("scalevec_train.infra.progress.time.monotonic", lambda: next(clock))
    progress = Progress()  # start-up at 0
    progress.mark("data", 1)  # 1: start-up took 1
    progress.mark("forward/backward", 1)  # 1.5: the same span
    progress.mark("data", 2)  # 4: step 1 took 3
    with progress.phase("checkpoint", 2):  # 4.5: step 2 took 0.5 so far
        assert progress.where == (2, "checkpoint", 4.5)
    assert progress.where == (2, "data", 10.0)  # 10: the checkpoint took 5.5; a span of data anew
    progress.mark("optimizer", 2)  # 11
    progress.mark("data", 3)  # 13: the rest of step 2 took 3
    assert progress.recent == {"start-up": (1.0,), "step": (3.0, 0.5, 3.0), "checkpoint": (5.5,)}
    assert progress.slowest("step") == 3.0 and progress.slowest("evaluation") == 0.0


def published(step: int, phase: str, count: int, elapsed: float = 12.0) -> dict:
    return {"step": step, "phase": phase, "elapsed": elapsed, "count": count}


def test_culprits_names_the_silent_ranks_else_those_behind_else_every_rank():
    first = {0: published(3, "optimizer", 10), 1: published(3, "optimizer", 4),
             2: published(3, "optimizer", 7), 3: published(3, "data", 9)}
    second = {**first, 0: published(3, "optimizer", 13, 14.4),
              2: published(3, "optimizer", 9, 14.6)}
    assert culprits(first, second, 0) == (
        "Ranks 1, 3 show no sign of life (stopped, frozen, or their host lost; last seen: rank 3 "
        "in data of step 3; rank 1 in optimizer of step 3); running: ranks 0, 2 in optimizer of "
        "step 3 (14 s)")
    second[3] = published(3, "data", 12, 15.0)
    second[1] = published(3, "optimizer", 5, 14.0)
    assert culprits(first, second, 0) == (
        "Rank 3 did not arrive: rank 3 in data of step 3 (15 s), while the others wait: ranks 0-2 "
        "in optimizer of step 3 (14 s)")
    second[3] = published(3, "optimizer", 13, 15.0)
    assert culprits(first, second, 0) == (
        "Every rank is in optimizer of step 3 (14 s): one is stuck there, or a collective does not "
        "complete (the stacks show which)")
    # the reader counts as running whatever it published; a rank never published is silent
    assert culprits({0: None, 1: None}, {0: None, 1: None}, 0) == (
        "Rank 1 shows no sign of life (stopped, frozen, or its host lost; never seen)")
    assert culprits(None, second, 0) == (
        "The other ranks are unknown: the process group's store did not answer")


def test_the_timeouts_and_the_floor_are_checked():
    for overrides, key, problem in [
        (["distributed.timeout_s=0"], "distributed.timeout_s",
         "0.0 is not a positive number of seconds."),
        (["distributed.init_timeout_s=-1"], "distributed.init_timeout_s",
         "-1.0 is not a positive number"),
        (["distributed.sigterm_grace_s=0"], "distributed.sigterm_grace_s",
         "0.0 is not a positive number"),
        (["distributed.hang_s=300"], "distributed.hang_s",
         "300.0 is not in [0, distributed.timeout_s=300.0): a collective would time out before the "
         "watchdog named the rank it waits for."),
        (["distributed.hang_s=-1"], "distributed.hang_s", "-1.0 is not in [0, "),
    ]:
        with pytest.raises(ScalevecError) as info:
            make_config(*overrides)
        assert (str(info.value).startswith(f"{key}: {problem}")
                and " Fix: " in str(info.value)), str(info.value)
    assert make_config("distributed.hang_s=0").distributed.hang_s == 0


def test_the_hang_actions_and_the_loader_point_are_faults(monkeypatch):
    monkeypatch.setenv(FAULT_AT_ENV, "data.batch:3@1=hang,step.start:2=sleep,data.batch:4")
    check_faults()


def test_the_bound_follows_the_slowest_recent_span_and_shortens_after_sigterm(tmp_path):
    """One process (no store): max(floor, 5x the slowest recent step and span of the phase's kind);
    a kind not measured yet is not judged; after SIGTERM, max(the grace, 3x that scale) where it is
    shorter."""
    progress = Progress()
    watchdog = Watchdog(progress, 10.0, tmp_path, 10.0)
    assert watchdog.bound("data")[0] == watchdog.bound("checkpoint")[0] == float("inf")
    progress.recent = {"step": (1.0, 3.0, 0.5)}
    assert watchdog.bound("optimizer") == (
        15.0, "the larger of distributed.hang_s=10 and 5x the slowest recent step (3.00 s)")
    assert watchdog.bound("evaluation")[0] == float("inf")
    progress.recent["checkpoint"] = (4.0,)
    assert watchdog.bound("checkpoint") == (
        20.0,
        "the larger of distributed.hang_s=10 and 5x the slowest recent step or checkpoint (4.00 s)")
    progress.recent["step"] = (1.0,)
    assert watchdog.bound("record")[0] == 10.0
    watchdog.sigterm_at = 0.0
    assert watchdog.bound("record")[0] == 10.0  # max(10, 3x1) is not shorter
    assert watchdog.bound("checkpoint") == (
        12.0, "after a SIGTERM, the larger of distributed.sigterm_grace_s=10 and 3x the slowest "
              "recent step or checkpoint (4.00 s)")

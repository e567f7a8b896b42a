"""Reliability with real processes and signals: crashes, restarts, SIGTERM, non-finite steps (bad
input: test_bad_input.py).

The reference is one plain process (the trainer in this process) training the same shrunk moe-tiny
(the expert biases are part of what must survive) for as many steps as the run under test ended
with.
Runs that get a signal are given far more steps than they can train before it (train.steps=10**6
with a constant LR after warmup, so that the length of a run changes none of its steps): whenever
the signal lands, the run is in the middle, and the test then works with the step it stopped at.
Against the reference:
  - a 2-rank torchrun run with every process SIGKILLed after its first checkpoint, relaunched with
    resume=auto, must log the reference's per-step losses (a resumed run appends records: the last
    record of a step counts); that relaunch then gets SIGTERM at its torchrun launcher (below), so
    one launch serves both;
  - under `torchrun --max-restarts=1 ... resume=auto`, SIGKILL of the rank-1 worker must restart the
    group from the newest checkpoint by itself, and SIGTERM to the new rank 1 alone must then stop
    both ranks at one step with a checkpoint and a clean exit;
  - SIGTERM to a single process, or to the torchrun launcher, must leave a complete checkpoint of
    the step the run stopped at and a clean exit; resume=auto then continues with the reference.
Non-finite steps are injected with SCALEVEC_FAULT_AT's step.loss faults (nan, infgrad), also on
one rank only: a skipped step must leave parameters and optimizer state bit-identical on every rank,
and too many in a row must stop every rank at the same step.
"""

import math
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.infra.faults import FAULT_AT_ENV
from scalevec_train.train import run
from scalevec_train.training.guards import StepGuard
from tests.support.helpers import make_config
from tests.support.launch import (
    assert_identical,
    assert_same_curve,
    assert_same_tensors,
    child_env,
    complete_steps,
    curve,
    final_model,
    latest_step,
    records,
    train_command,
    train_in_process,
    trained_state,
)
from tests.support.presets import SMALL_MODEL

EVERY = 3
# Dense: the numerical guards' runs.
TINY = [*SMALL_MODEL, "model.ffn_dim=128",
        "train.seq_len=32", "train.global_batch=4", "train.eval_batches=2", "train.eval_every=0",
        "schedule.warmup_steps=2", "train.steps=40", "train.log_every=1",
        f"checkpoint.every={EVERY}"]
# Every micro-batch is 2 sequences on 1 and on 2 ranks: the MoE load-balancing loss is the same
# function.
MOE = ["model=moe-tiny", *SMALL_MODEL, "model.ffn_dim=64", "model.moe.expert_dim=32",
       "model.moe.aux_loss_coef=0.01", "train.seq_len=32",
       "train.global_batch=4", "train.micro_batch=2", "train.eval_batches=2", "train.eval_every=0",
       "schedule=constant", "schedule.warmup_steps=2", "train.log_every=1",
       f"checkpoint.every={EVERY}"]
ENDLESS = f"train.steps={10**6}"
# 2 ranks against 1 process (parameters): fp32 sums in another order differ by about 1e-7 relative,
# which Adam's normalized steps turn into a few 1e-6 over some 20 steps; a lost or repeated step
# moves them by about lr = 3e-3.
ATOL = 1e-5


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    return [*data_overrides, *TINY]


@pytest.fixture(scope="module")
def moe(data_overrides) -> list[str]:
    prepare_data(make_config(*data_overrides).data)  # here, once, rather than by 2 ranks at a time
    return [*data_overrides, *MOE]


@pytest.fixture(scope="module")
def reference(moe, tmp_path_factory):
    """steps -> the run directory of the one-process run of that many steps."""
    root = tmp_path_factory.mktemp("reference")

    def get(steps: int) -> Path:
        run_dir = root / str(steps)
        if not run_dir.exists():
            run(make_config(*moe, f"train.steps={steps}", f"run_dir={run_dir}"))
        return run_dir
    return get


def assert_reference_run(run_dir: Path, steps: int, reference, scratch: Path) -> None:
    """Losses of steps 1..steps and the parameters (expert biases included) of the checkpoint at
    `steps` equal those of the uninterrupted one-process run."""
    expected = reference(steps)
    assert_same_curve({s: v for s, v in curve(run_dir).items() if s <= steps}, curve(expected),
                      range(1, steps + 1))
    assert_same_tensors(final_model(run_dir, steps, scratch), final_model(expected, steps, scratch),
                        atol=ATOL)


def checkpointed_and_beyond(run_dir: Path) -> bool:
    """A complete checkpoint exists and training went on past it (a kill then loses steps)."""
    saved = complete_steps(run_dir)
    return bool(saved) and latest_step(run_dir) > saved[-1]


# Crashes and restarts.

def test_max_restarts_resumes_after_a_kill_then_sigterm_to_one_rank_stops_both(
        moe, reference, processes, tmp_path):
    run_dir = tmp_path / "restarted"
    started = processes.start(train_command(2, *moe, ENDLESS, f"run_dir={run_dir}", "resume=auto",
                                            restarts=1),
                              tmp_path)
    started.wait_until(lambda: checkpointed_and_beyond(run_dir), "training past a checkpoint")
    os.kill(processes.worker(1), signal.SIGKILL)

    def restarted_and_training() -> bool:
        """torchrun stopped the old group and started a new one (its rank 0 printed run_dir again),
        which trained a step (each logged record is a stdout line with loss=): both ranks are in the
        loop."""
        out = started.output()
        return out.count("run_dir: ") == 2 and "loss=" in out.rsplit("run_dir: ", 1)[1]

    started.wait_until(restarted_and_training, "a step trained by the restarted group")
    os.kill(processes.worker(1), signal.SIGTERM)
    assert started.wait() == 0, started.describe()
    stopped = records(run_dir)[-1]
    assert stopped["stopped"] == "SIGTERM"
    ckpt = checkpoint_files.complete_checkpoints(run_dir)[-1]
    assert ckpt == checkpoint_files.step_dir(run_dir, stopped["step"])
    # both ranks saved
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert f"stopped by SIGTERM after step {stopped['step']}" in started.output()
    # the restart resumed
    assert Counter(r["step"] for r in records(run_dir) if "loss" in r)[1] == 1
    assert_reference_run(run_dir, stopped["step"], reference, tmp_path)


# SIGTERM.

def assert_stopped_by_sigterm(run_dir: Path, output: str) -> int:
    """The run logged its stop, saved the step it stopped at, and said so; returns that step."""
    stopped = records(run_dir)[-1]
    assert stopped["stopped"] == "SIGTERM"
    assert (checkpoint_files.complete_checkpoints(run_dir)[-1]
            == checkpoint_files.step_dir(run_dir, stopped["step"]))
    assert f"stopped by SIGTERM after step {stopped['step']}" in output
    return stopped["step"]


def resume_in_process(moe, run_dir: Path, steps: int) -> None:
    run(make_config(*moe, f"train.steps={steps}", f"run_dir={run_dir}", "resume=auto"))


def test_sigkill_of_every_process_then_resume_auto_then_sigterm_to_torchrun(
        moe, reference, processes, tmp_path):
    """A 2-rank run SIGKILLed (every process) past a checkpoint, its metrics cut inside a line,
    resumes with resume=auto; that launch, once it has logged again every step the killed one did
    and trained on, gets SIGTERM at its torchrun launcher, which stops both ranks at one step with a
    checkpoint of it; one process resumes that and ends with the uninterrupted run."""
    run_dir = tmp_path / "killed"
    started = processes.start(train_command(2, *moe, ENDLESS, f"run_dir={run_dir}"), tmp_path)
    started.wait_until(lambda: checkpointed_and_beyond(run_dir), "training past a checkpoint")
    processes.kill()
    assert started.wait() == -signal.SIGKILL
    last, logged = complete_steps(run_dir)[-1], latest_step(run_dir)
    # As if the kill had hit while a record was being appended (it may have: then that line goes
    # too).
    kept = len(records(run_dir))
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 99, "lo')

    def resumed() -> list[int]:
        return [r["step"] for r in records(run_dir)[kept:] if "loss" in r]

    # the resumed run logs again every step the killed one did, and trains on
    started = processes.start(train_command(2, *moe, ENDLESS, f"run_dir={run_dir}", "resume=auto"),
                              tmp_path)
    started.wait_until(lambda: max(resumed(), default=-1) > logged,
                       "the resumed run past the killed one's steps")
    started.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
    # torchrun itself reports the signal it got (SignalException, exit code 1); its workers stop
    # cleanly
    assert started.wait() == 1, started.describe()
    assert "SignalException" in started.output() and "Error executing job" not in started.output()
    step = assert_stopped_by_sigterm(run_dir, started.output())
    assert resumed() == list(range(last + 1, step + 1))  # every line parses again
    ckpt = checkpoint_files.step_dir(run_dir, step)
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resume_in_process(moe, run_dir, step + 2)  # on one process
    assert_reference_run(run_dir, step + 2, reference, tmp_path)


def test_sigterm_checkpoints_the_current_step_and_exits_cleanly(
        moe, reference, processes, tmp_path):
    run_dir = tmp_path / "sigterm"
    started = processes.start(train_command(1, *moe, ENDLESS, f"run_dir={run_dir}"), tmp_path)
    started.wait_until(lambda: latest_step(run_dir) >= 1, "a training step")
    started.proc.send_signal(signal.SIGTERM)
    assert started.wait() == 0, started.describe()
    step = assert_stopped_by_sigterm(run_dir, started.output())
    assert "Traceback" not in started.output()
    resume_in_process(moe, run_dir, step + 2)
    assert_reference_run(run_dir, step + 2, reference, tmp_path)


# Numerical guards.

def test_a_non_finite_step_is_skipped_and_counted(common, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_AT_ENV, "step.loss:3=nan")
    run_dir = run(make_config(*common, "train.micro_batch=2", "train.steps=6", "train.log_every=2",
                              "checkpoint.every=1", "checkpoint.keep_last=10",
                              f"run_dir={tmp_path / 'r'}"))
    by_step = {r["step"]: r for r in records(run_dir)}
    # the bad step is logged too
    assert sorted(s for s, r in by_step.items() if "lr" in r) == [2, 3, 4, 6]
    bad = by_step[3]
    assert bad["bad_step"] is True and bad["bad_loss"] == "nan" and "loss" not in bad
    assert [by_step[s]["skipped_steps"] for s in (2, 3, 4, 6)] == [0, 1, 1, 1]
    assert math.isfinite(by_step[6]["loss"]) and "bad_step" not in by_step[4]

    state = {s: trained_state(checkpoint_files.step_dir(run_dir, s), tmp_path) for s in (2, 3, 4)}
    assert_identical(state[3], state[2])  # nothing moved
    # trains on
    assert not torch.equal(state[4]["model/tok_emb.weight"], state[3]["model/tok_emb.weight"])
    saved = checkpoint_files.read_train_state(checkpoint_files.step_dir(run_dir, 3))
    assert saved["loader"]["position"] == 3 * 4  # the bad step's batch counts as used
    assert saved["guard"]["skipped_steps"] == 1


def test_repeated_non_finite_steps_stop_the_run_with_the_last_good_state(
        common, tmp_path, capfd, monkeypatch):
    """The command's exit code and output, the command run in this process (a one-process launch of
    it: test_sigterm_checkpoints_the_current_step_and_exits_cleanly)."""
    run_dir = tmp_path / "diverged"
    nan_losses = {FAULT_AT_ENV: ",".join(f"step.loss:{s}=nan" for s in (4, 5, 6, 7))}
    code, output = train_in_process([*common, "train.micro_batch=2", "train.steps=10",
                                     "checkpoint.every=3", "train.max_bad_steps=3",
                                     f"run_dir={run_dir}"],
                                    nan_losses, tmp_path, capfd, monkeypatch)
    assert code == 3, output
    assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: training (steps 4-6): 3 steps in a row had a "
                                "non-finite loss")
    assert "train.max_bad_steps=3" in errors[0] and "of step 3, the last good one" in errors[0]
    assert " Fix: " in errors[0]
    assert [line for line in output.splitlines() if " skipped: loss nan" in line][0].startswith(
        "warning: step 4 skipped")
    assert records(run_dir)[-1]["stopped"] == "diverged"

    good, stop = checkpoint_files.step_dir(run_dir, 3), checkpoint_files.step_dir(run_dir, 6)
    assert checkpoint_files.complete_checkpoints(run_dir) == [good, stop]
    assert_identical(trained_state(stop, tmp_path), trained_state(good, tmp_path))
    saved = checkpoint_files.read_train_state(stop)
    assert saved["loader"]["position"] == 6 * 4
    assert saved["guard"] == {"skipped_steps": 3, "bad_streak": 3,
                              "loss_ema": saved["guard"]["loss_ema"]}


def test_faults_on_one_rank_are_skipped_or_stop_every_rank_at_one_step(moe, processes, tmp_path):
    """2 ranks: a NaN loss on rank 1 alone (step 3), an infinite gradient under a finite loss on
    rank 0 alone (step 5), then NaN losses on rank 1 at steps 7 and 8 with train.max_bad_steps=2.
    Every rank skips the same steps (a skipped step leaves the parameters, the optimizer state and
    the expert biases of every shard bit-identical) and both stop at step 8 with the state of step 6
    saved."""
    run_dir = tmp_path / "faults"
    env = child_env(**{FAULT_AT_ENV: "step.loss:3@1=nan,step.loss:5@0=infgrad,step.loss:7@1=nan,"
                                     "step.loss:8@1=nan"})
    # a rank that fails makes torchrun exit with 1; the root cause it reports is the divergence,
    # exit code 3
    output = processes.run(train_command(2, *moe, "train.steps=10", "train.max_bad_steps=2",
                                         "checkpoint.every=1", "checkpoint.keep_last=20",
                                         f"run_dir={run_dir}"), tmp_path, env, code=1)
    assert "exitcode  : 3" in output and "error: training (steps 7-8)" in output
    by_step = {r["step"]: r for r in records(run_dir)}
    assert [s for s, r in by_step.items() if r.get("bad_step")] == [3, 5, 7, 8]
    assert by_step[3]["bad_loss"] == "nan"
    assert (math.isfinite(float(by_step[5]["bad_loss"]))
            and not math.isfinite(float(by_step[5]["bad_grad_norm"])))
    assert [by_step[s]["skipped_steps"] for s in range(1, 9)] == [0, 0, 1, 1, 2, 2, 3, 4]
    assert by_step[8]["stopped"] == "diverged" and max(by_step) == 8

    state = {s: trained_state(checkpoint_files.step_dir(run_dir, s), tmp_path) for s in range(2, 9)}
    for skipped, before in ((3, 2), (5, 4), (8, 6)):
        assert_identical(state[skipped], state[before])
        assert (sorted(p.name
                       for p in checkpoint_files.step_dir(run_dir, skipped).glob("*.distcp"))
                == ["__0_0.distcp", "__1_0.distcp"])
    for step in (4, 6):  # trains on in between
        assert not torch.equal(state[step]["model/tok_emb.weight"],
                               state[step - 1]["model/tok_emb.weight"])
    assert any(not torch.equal(v, state[2][k]) for k, v in state[6].items()
               if k.endswith("expert_bias"))
    saved = checkpoint_files.read_train_state(checkpoint_files.step_dir(run_dir, 8))
    assert saved["loader"]["position"] == 8 * 4 and saved["guard"]["skipped_steps"] == 4


def test_loss_spikes_are_flagged_against_a_running_average():
    guard = StepGuard(max_bad_steps=2, spike_factor=1.5)
    steps = [(4.0, 1.0), (3.0, 1.0), (float("nan"), 1.0), (3.0, 1.0), (7.0, 1.0),
             (3.0, float("inf")), (3.0, 1.0)]
    ema, verdicts = None, []
    for loss, grad_norm in steps:
        verdicts.append(guard.observe(loss, grad_norm))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            spike = ema is not None and loss > 1.5 * ema
            assert verdicts[-1] == ({"loss_spike": True, "loss_ema": pytest.approx(ema)} if spike
                                    else {})
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        else:
            assert verdicts[-1]["bad_step"] is True
    assert ([bool(v.get("loss_spike")) for v in verdicts]
            == [False, False, False, False, True, False, False])
    assert guard.skipped == 2 and guard.streak == 0 and not guard.diverged
    guard.observe(float("nan"), 1.0)
    guard.observe(1.0, float("nan"))
    assert guard.diverged


# Bad input: each fails on its own, before expensive work, and changes no run directory.

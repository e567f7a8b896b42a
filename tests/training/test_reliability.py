"""Reliability with real processes and signals: crashes, restarts, SIGTERM, non-finite steps, bad input.

The reference is an uninterrupted 2-rank torchrun run (FSDP2 over gloo, fp32 on CPU). Against it:
  - the same run with every process SIGKILLed mid-training and relaunched with resume=auto, and one
    whose rank-1 worker is SIGKILLed under `torchrun --max-restarts=1` (which restarts the group by
    itself, resume=auto on its command line), must end with the reference's per-step losses and final
    parameters (a resumed run appends records: the last record of a step counts);
  - SIGTERM, to a single process or to the torchrun launcher, must leave a complete checkpoint of the
    step the run stopped at and a clean exit; resume=auto then finishes with the reference losses.
Non-finite steps are injected with SCALEVEC_FAULT_NAN_STEPS; a skipped step must leave parameters and
optimizer state bit-identical. Bad inputs, through the command line and in-process, must each fail with
their own message before expensive work, and leave every run directory byte-identical.
"""

import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.data import tokenizer as sp_tokenizer
from scalevec_train.errors import ScalevecError
from scalevec_train.train import run
from scalevec_train.training.guards import FAULT_NAN_ENV, StepGuard
from tests.helpers import REPO, make_config

STEPS, EVERY, KILL_AFTER = 40, 5, 8
TINY = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "model.n_layers=2",
        "train.seq_len=32", "train.global_batch=4", "train.eval_batches=2", "train.eval_every=0",
        "schedule.warmup_steps=2", f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every={EVERY}"]
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "HYDRA_FULL_ERROR", FAULT_NAN_ENV)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def one_process(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "scalevec_train.train", *overrides]


def torchrun(*overrides: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={restarts}", "-m", "scalevec_train.train", "train.micro_batch=1", *overrides]


def launch(command: list[str], cwd: Path) -> None:
    proc = subprocess.run(command, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


class Started:
    """A training process running in the background; its output goes to a file (no pipe to fill)."""

    def __init__(self, command: list[str], cwd: Path, run_dir: Path):
        self.run_dir, self.log = run_dir, cwd / f"{run_dir.name}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, cwd=cwd, env=child_env(), stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def wait_for_step(self, step: int) -> int:
        """Blocks until metrics.jsonl holds a record of `step` or later; returns the latest step."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the run ended before step {step}:\n{self.output()[-5000:]}"
            latest = max(records(self.run_dir, strict=False), key=lambda r: r["step"], default={"step": -1})
            if latest["step"] >= step:
                return latest["step"]
            time.sleep(0.02)
        raise AssertionError(f"no step {step} within the time limit:\n{self.output()[-5000:]}")

    def wait(self) -> int:
        return self.proc.wait(timeout=300)


def records(run_dir: Path, strict: bool = True) -> list[dict]:
    """The metrics records in file order. strict=False skips a line being written right now."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if strict:
                raise
    return out


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a resumed run logs steps after its checkpoint again, and the last record counts."""
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def assert_same_losses(got: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=0), step


def checkpoint_state(ckpt: Path, scratch: Path) -> dict:
    """A DCP checkpoint as one state dict ({"model": ..., "optim": ...}), read in this process."""
    assert (ckpt / checkpoint_files.COMPLETE).is_file(), ckpt
    out = scratch / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=True)


def assert_same_params(run_dir: Path, expected: dict[str, torch.Tensor], scratch: Path) -> None:
    got = checkpoint_state(checkpoint_files.step_dir(run_dir, STEPS), scratch)["model"]
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from the parent pids in /proc (torchrun's workers run in sessions
    of their own, so a process-group kill would miss them)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += parents.get(tree[-1], [])
    return tree


def worker_of_rank(launcher: int, rank: int) -> int:
    for pid in process_tree(launcher)[1:]:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    return [*data_overrides, *TINY]


@dataclass
class Reference:
    losses: dict[int, float]
    params: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def reference(common, tmp_path_factory) -> Reference:
    """The uninterrupted 2-rank run."""
    run_dir = tmp_path_factory.mktemp("reliability") / "reference"
    launch(torchrun(*common, f"run_dir={run_dir}"), cwd=run_dir.parent)
    params = checkpoint_state(checkpoint_files.step_dir(run_dir, STEPS), run_dir.parent)["model"]
    curve = losses(run_dir)
    assert curve[STEPS] < curve[1] - 0.2  # it trains
    return Reference(curve, params)


# Crashes and restarts.

def test_sigkill_of_every_process_then_resume_auto_gives_the_uninterrupted_run(common, reference, tmp_path):
    run_dir = tmp_path / "killed"
    started = Started(torchrun(*common, f"run_dir={run_dir}"), tmp_path, run_dir)
    started.wait_for_step(KILL_AFTER)
    tree = process_tree(started.proc.pid)
    assert len(tree) >= 3  # the launcher and its two workers
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    started.wait()
    deadline = time.monotonic() + 30
    while not all(map(gone, tree)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(gone, tree))
    assert max(r["step"] for r in records(run_dir)) < STEPS  # killed before the end
    last = int(checkpoint_files.complete_checkpoints(run_dir)[-1].name.split("_")[1])
    assert EVERY <= last < STEPS
    # As if the kill had hit while a record was being appended.
    kept = len(records(run_dir))
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 99, "lo')

    launch(torchrun(*common, f"run_dir={run_dir}", "resume=auto"), cwd=tmp_path)
    resumed = [r["step"] for r in records(run_dir)[kept:] if "loss" in r]  # every line parses again
    assert resumed == list(range(last + 1, STEPS + 1))
    assert_same_losses(losses(run_dir), reference.losses)
    assert_same_params(run_dir, reference.params, tmp_path)


def test_torchrun_max_restarts_resumes_by_itself_after_one_rank_is_killed(common, reference, tmp_path):
    run_dir = tmp_path / "restarted"
    started = Started(torchrun(*common, f"run_dir={run_dir}", "resume=auto", restarts=1), tmp_path, run_dir)
    started.wait_for_step(KILL_AFTER)
    os.kill(worker_of_rank(started.proc.pid, 1), signal.SIGKILL)
    assert started.wait() == 0, started.output()[-5000:]
    assert started.output().count("run_dir: ") == 2  # rank 0 started twice
    assert Counter(r["step"] for r in records(run_dir) if "loss" in r)[1] == 1  # from a checkpoint
    assert_same_losses(losses(run_dir), reference.losses)
    assert_same_params(run_dir, reference.params, tmp_path)


# SIGTERM.

def test_sigterm_checkpoints_the_current_step_and_exits_cleanly(common, reference, tmp_path):
    run_dir = tmp_path / "sigterm"
    started = Started(one_process(*common, "train.micro_batch=2", f"run_dir={run_dir}"), tmp_path, run_dir)
    seen = started.wait_for_step(KILL_AFTER)
    started.proc.send_signal(signal.SIGTERM)
    assert started.wait() == 0, started.output()[-5000:]
    last = records(run_dir)[-1]
    assert last["stopped"] == "SIGTERM" and seen <= last["step"] < STEPS
    assert checkpoint_files.complete_checkpoints(run_dir)[-1] == checkpoint_files.step_dir(run_dir, last["step"])
    assert f"stopped by SIGTERM after step {last['step']}" in started.output()
    assert "Traceback" not in started.output()

    launch(one_process(*common, "train.micro_batch=2", f"run_dir={run_dir}", "resume=auto"), cwd=tmp_path)
    assert_same_losses(losses(run_dir), reference.losses)  # one process against two ranks: rel 1e-5


def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_with_a_checkpoint(common, reference, tmp_path):
    run_dir = tmp_path / "sigterm_torchrun"
    started = Started(torchrun(*common, f"run_dir={run_dir}"), tmp_path, run_dir)
    seen = started.wait_for_step(KILL_AFTER)
    started.proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
    started.wait()  # torchrun itself reports the signal it got; its workers exit cleanly
    last = records(run_dir)[-1]
    assert last["stopped"] == "SIGTERM" and seen <= last["step"] < STEPS
    ckpt = checkpoint_files.complete_checkpoints(run_dir)[-1]
    assert ckpt == checkpoint_files.step_dir(run_dir, last["step"])
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert "Error executing job" not in started.output()

    launch(torchrun(*common, f"run_dir={run_dir}", "resume=auto"), cwd=tmp_path)
    assert_same_losses(losses(run_dir), reference.losses)
    assert_same_params(run_dir, reference.params, tmp_path)


# Numerical guards.

def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return {k: v for key, value in items
            for k, v in flat_tensors(value, f"{prefix}/{key}" if prefix else str(key)).items()}


def trained_state(ckpt: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state (moments, step counts); not the learning rate, which the schedule
    sets before every step."""
    state = checkpoint_state(ckpt, scratch)
    return flat_tensors({"model": state["model"], "optim": state["optim"]["state"]})


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_non_finite_step_is_skipped_and_counted(common, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_NAN_ENV, "3")
    run_dir = run(make_config(*common, "train.micro_batch=2", "train.steps=6", "train.log_every=2",
                              "checkpoint.every=1", "checkpoint.keep_last=10", f"run_dir={tmp_path / 'r'}"))
    by_step = {r["step"]: r for r in records(run_dir)}
    assert sorted(s for s, r in by_step.items() if "lr" in r) == [2, 3, 4, 6]  # the bad step is logged too
    bad = by_step[3]
    assert bad["bad_step"] is True and bad["bad_loss"] == "nan" and "loss" not in bad
    assert [by_step[s]["skipped_steps"] for s in (2, 3, 4, 6)] == [0, 1, 1, 1]
    assert math.isfinite(by_step[6]["loss"]) and "bad_step" not in by_step[4]

    state = {s: trained_state(checkpoint_files.step_dir(run_dir, s), tmp_path) for s in (2, 3, 4)}
    assert_identical(state[3], state[2])  # nothing moved
    assert not torch.equal(state[4]["model/tok_emb.weight"], state[3]["model/tok_emb.weight"])  # trains on
    saved = checkpoint_files.read_train_state(checkpoint_files.step_dir(run_dir, 3))
    assert saved["loader"]["position"] == 3 * 4  # the bad step's batch counts as used
    assert saved["guard"]["skipped_steps"] == 1


def test_repeated_non_finite_steps_stop_the_run_with_the_last_good_state(common, tmp_path):
    run_dir = tmp_path / "diverged"
    proc = subprocess.run(one_process(*common, "train.micro_batch=2", "train.steps=10", "checkpoint.every=3",
                                      "train.max_bad_steps=3", f"run_dir={run_dir}"),
                          cwd=tmp_path, env=child_env(**{FAULT_NAN_ENV: "4,5,6,7"}), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-5000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: training (steps 4-6): 3 steps in a row had a non-finite loss")
    assert "train.max_bad_steps=3" in errors[0] and "of step 3, the last good one" in errors[0]
    assert " Fix: " in errors[0]
    assert [line for line in proc.stderr.splitlines() if " skipped: loss nan" in line][0].startswith(
        "warning: step 4 skipped")
    assert records(run_dir)[-1]["stopped"] == "diverged"

    good, stop = checkpoint_files.step_dir(run_dir, 3), checkpoint_files.step_dir(run_dir, 6)
    assert checkpoint_files.complete_checkpoints(run_dir) == [good, stop]
    assert_identical(trained_state(stop, tmp_path), trained_state(good, tmp_path))
    saved = checkpoint_files.read_train_state(stop)
    assert saved["loader"]["position"] == 6 * 4
    assert saved["guard"] == {"skipped_steps": 3, "bad_streak": 3, "loss_ema": saved["guard"]["loss_ema"]}


def test_loss_spikes_are_flagged_against_a_running_average():
    guard = StepGuard(max_bad_steps=2, spike_factor=1.5)
    steps = [(4.0, 1.0), (3.0, 1.0), (float("nan"), 1.0), (3.0, 1.0), (7.0, 1.0), (3.0, float("inf")),
             (3.0, 1.0)]
    ema, verdicts = None, []
    for loss, grad_norm in steps:
        verdicts.append(guard.observe(loss, grad_norm))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            spike = ema is not None and loss > 1.5 * ema
            assert verdicts[-1] == ({"loss_spike": True, "loss_ema": pytest.approx(ema)} if spike else {})
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
        else:
            assert verdicts[-1]["bad_step"] is True
    assert [bool(v.get("loss_spike")) for v in verdicts] == [False, False, False, False, True, False, False]
    assert guard.skipped == 2 and guard.streak == 0 and not guard.diverged
    guard.observe(float("nan"), 1.0)
    guard.observe(1.0, float("nan"))
    assert guard.diverged


# Bad input: each fails on its own, before expensive work, and changes no run directory.

def tree_digest(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing(common, tmp_path_factory) -> Path:
    """A finished one-process run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("bad_input") / "existing"
    run(make_config(*common, "train.micro_batch=2", "train.steps=4", "checkpoint.every=2", f"run_dir={run_dir}"))
    assert [p.name for p in checkpoint_files.complete_checkpoints(run_dir)] == ["step_000002", "step_000004"]
    return run_dir


@pytest.fixture(scope="module")
def prepared(common) -> Path:
    return prepare_data(make_config(*common, "train.micro_batch=2").data).root


@dataclass
class Ctx:
    tmp: Path
    existing: Path
    prepared: Path
    guarded: list[Path] = field(default_factory=list)  # directories that must stay byte-identical

    def copy_run(self) -> Path:
        dst = self.tmp / "run_copy"
        shutil.copytree(self.existing, dst)
        self.guarded.append(dst)
        return dst

    def checkpoint(self) -> Path:
        return checkpoint_files.complete_checkpoints(self.copy_run())[-1]

    def shards(self) -> Path:
        dst = self.tmp / "shards"
        shutil.copytree(self.prepared, dst)
        return dst


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 if keep is None else keep])


def foreign_tokens(shards: Path) -> None:
    """Same size as the shard it replaces, but not tokens of this vocabulary."""
    shard = shards / "train" / "00000.bin"
    shard.write_bytes(b"\xff" * shard.stat().st_size)


def other_tokenizer(ctx: Ctx) -> Path:
    out = ctx.tmp / "other.model"
    lines = [f"line {i} of another corpus with words {i * 7} and {i * 13}" for i in range(400)]
    sp_tokenizer.train(lines, 300, "bpe", out)
    return out


def corrupt_metadata(ckpt: Path) -> None:
    (ckpt / ".metadata").write_bytes(b"not a pickle")


class CallOnLoad:
    """Pickles to a function call: a crafted .metadata must be refused, not executed."""

    def __reduce__(self):
        return (os.getcwd, ())


def code_in_metadata(ckpt: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(CallOnLoad()))


def with_file(ctx: Ctx) -> Path:
    (ctx.tmp / "a_file").write_text("")
    return ctx.tmp / "a_file"


def incomplete_dir(ctx: Ctx) -> Path:
    ckpt = ctx.checkpoint()
    (ckpt / checkpoint_files.COMPLETE).unlink()
    return ckpt


def existing_run(*overrides: str):
    return lambda ctx: [f"run_dir={ctx.existing}", "resume=auto", *overrides]


def on_copy(damage):
    """The existing run copied, one file of its newest checkpoint damaged, resumed with resume=auto."""
    def setup(ctx: Ctx) -> list[str]:
        ckpt = ctx.checkpoint()
        damage(ckpt)
        return [f"run_dir={ckpt.parent.parent}", "resume=auto"]
    return setup


def shards_with(ctx: Ctx, damage) -> Path:
    shards = ctx.shards()
    damage(shards)
    return shards


def bad_manifest(shards: Path) -> None:
    path = shards / "val" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["num_tokens"] += 1
    path.write_text(json.dumps(manifest))


def truncate_shard(shards: Path) -> None:
    truncate(shards / "train" / "00000.bin")


def empty_dir(ctx: Ctx) -> Path:
    (ctx.tmp / "empty").mkdir()
    return ctx.tmp / "empty"


@dataclass
class Case:
    name: str
    # config: fails while the config is composed; before_data: data preparation must not start;
    # before_model: the model must not be initialized
    stage: str
    # ctx -> overrides, applied after run_dir=<a fresh folder that must stay absent>
    setup: object
    message: str  # a part of the one-line message
    world: int = 1
    env: dict = field(default_factory=dict)


IN_PROCESS = [
    Case("heads", "config", existing_run("model.dim=100", "model.n_heads=3"), "model.dim: hidden size 100"),
    Case("seq_len", "config", existing_run("train.seq_len=2048"), "train.seq_len: 2048 is longer"),
    Case("optimizer", "config", existing_run("optim.name=sgd"), "optim.name"),
    Case("warmup", "config", existing_run("schedule.warmup_steps=500"), "schedule.warmup_steps"),
    Case("max_bad_steps", "config", existing_run("train.max_bad_steps=0"), "train.max_bad_steps: must be"),
    Case("eval_split", "config", lambda ctx: ["train.global_batch=6", "train.eval_batches=2"],
         "train.eval_batches: 2 validation batches cannot be split evenly over 3 ranks", world=3),
    Case("run_dir_file", "before_data", lambda ctx: [f"run_dir={with_file(ctx)}"], "is a file, so it cannot"),
    Case("resume_none", "before_data", existing_run("resume=none"), "already holds checkpoints"),
    Case("resume_missing", "before_data", lambda ctx: [f"resume={ctx.tmp / 'nowhere'}"], "does not exist"),
    Case("resume_run_dir", "before_data", lambda ctx: [f"resume={ctx.existing}"], "is a run directory"),
    Case("resume_incomplete", "before_data", lambda ctx: [f"resume={incomplete_dir(ctx)}"],
         "is not a complete checkpoint"),
    Case("other_scale", "before_data", existing_run("scale=unified"), "does not fit this model"),
    Case("truncated_checkpoint", "before_data", on_copy(lambda c: truncate(c / "__0_0.distcp")),
         "__0_0.distcp: is truncated"),
    Case("corrupt_metadata", "before_data", on_copy(corrupt_metadata), ".metadata: cannot be read"),
    Case("code_in_metadata", "before_data", on_copy(code_in_metadata), "unexpected object posix.getcwd"),
    Case("corrupt_train_state", "before_data", on_copy(lambda c: truncate(c / "train_state.json", 10)),
         "train_state.json: cannot be read"),
    Case("other_seq_len", "before_model", existing_run("train.seq_len=16"), "data loader state (seq_len)"),
    Case("foreign_shard", "before_model",
         lambda ctx: ["data=shards", f"data.path={shards_with(ctx, foreign_tokens)}"],
         "00000.bin: holds token id 65535"),
    Case("manifest", "before_model", lambda ctx: ["data=shards", f"data.path={shards_with(ctx, bad_manifest)}"],
         "manifest.json: says num_tokens="),
    Case("tokenizer", "before_model", lambda ctx: ["data=shards", f"data.path={ctx.shards()}",
                                                   f"data.tokenizer_path={other_tokenizer(ctx)}"],
         "was written with tokenizer"),
    Case("vocab", "before_model", lambda ctx: ["data=shards", f"data.path={ctx.shards()}", "model.vocab_size=256"],
         "model.vocab_size: 256 is smaller"),
    Case("data_path", "before_model", lambda ctx: ["data.path=/nonexistent/corpus"],
         "/nonexistent/corpus is not a folder"),
    Case("empty_corpus", "before_model", lambda ctx: [f"data.path={empty_dir(ctx)}"], "empty corpus"),
    Case("fault_env", "before_data", lambda ctx: [], f"{FAULT_NAN_ENV}: 'x' is not", env={FAULT_NAN_ENV: "x"}),
]
MESSAGES: dict[str, str] = {}


def fail(what: str):
    def boom(*args, **kwargs):
        raise AssertionError(f"{what} started before the bad input was reported")
    return boom


@pytest.mark.parametrize("case", IN_PROCESS, ids=lambda c: c.name)
def test_bad_input_fails_early_with_its_own_message(case, common, existing, prepared, tmp_path, monkeypatch):
    ctx = Ctx(tmp_path, existing, prepared, guarded=[existing])
    overrides = case.setup(ctx)
    before = {d: tree_digest(d) for d in ctx.guarded}
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    if case.stage == "before_data":
        monkeypatch.setattr("scalevec_train.build.prepare_data", fail("data preparation"))
    monkeypatch.setattr("scalevec_train.build.parallelize", fail("model initialization"))
    with pytest.raises(ScalevecError) as info:
        run(make_config(*common, "train.micro_batch=2", f"run_dir={tmp_path / 'fresh'}", *overrides,
                        world_size=case.world))
    message = str(info.value)
    assert case.message in message, message
    assert " Fix: " in message and "\n" not in message
    for d in ctx.guarded:
        assert tree_digest(d) == before[d], d
    assert not (tmp_path / "fresh").exists()
    MESSAGES[case.name] = message


@dataclass
class CliCase:
    name: str
    args: object  # ctx -> overrides
    code: int
    message: str
    env: dict = field(default_factory=dict)


CLI = [
    CliCase("malformed_override", lambda ctx: ["train.steps"], 1, "Error parsing override 'train.steps'"),
    CliCase("unknown_preset", lambda ctx: ["model=dense-huge"], 1, "Could not find 'model/dense-huge'"),
    CliCase("unknown_key", lambda ctx: ["+train.warmup=5"], 2, "error: train.warmup: unknown key"),
    CliCase("wrong_type", lambda ctx: ["train.steps=many"], 2, "error: train.steps: Value 'many'"),
    CliCase("world_size", lambda ctx: [], 2, "error: train.global_batch: 4 sequences are not divisible by "
            "micro_batch * ranks = 2 * 3", env={"WORLD_SIZE": "3"}),
    CliCase("unwritable_run_dir", lambda ctx: [f"run_dir={with_file(ctx) / 'run'}"], 2,
            "would be a folder under the file"),
    CliCase("other_model", lambda ctx: ["model.dim=96"], 2, "was written by another model (differs in ['dim'])"),
    CliCase("kernels_on_cpu", lambda ctx: ["model.kernels=triton", "device=cpu"], 2,
            "error: model.kernels: kernels backend 'triton' needs CUDA tensors, got cpu."),
    CliCase("truncated_shard", lambda ctx: ["data=shards", f"data.path={shards_with(ctx, truncate_shard)}",
                                           f"run_dir={ctx.tmp / 'fresh'}"], 2, "00000.bin: is truncated"),
]


def test_bad_input_on_the_command_line_exits_nonzero_with_one_message(common, existing, prepared, tmp_path):
    """All cases run at once (they are independent processes) against the same existing run."""
    before = tree_digest(existing)
    started = []
    for case in CLI:
        ctx = Ctx(tmp_path / case.name, existing, prepared)
        ctx.tmp.mkdir()
        overrides = [*common, "train.micro_batch=2", f"run_dir={existing}", "resume=auto", *case.args(ctx)]
        proc = subprocess.Popen(one_process(*overrides), cwd=ctx.tmp, env=child_env(**case.env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        started.append((case, ctx, proc))
    for case, ctx, proc in started:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == case.code, (case.name, err[-3000:])
        assert case.message in err, (case.name, err[-3000:])
        assert "Traceback" not in err, case.name
        if case.code == 2:
            assert len(err.strip().splitlines()) == 1 and " Fix: " in err, (case.name, err)
        assert not (ctx.tmp / "fresh").exists()
        MESSAGES[f"cli:{case.name}"] = err.strip()
    assert tree_digest(existing) == before


def test_every_bad_input_has_its_own_message():
    """Runs after the cases above (file order); at least 20 distinct failures, none sharing a message."""
    if len(MESSAGES) < len(IN_PROCESS) + len(CLI):
        pytest.skip("needs the bad-input tests of this file to run first")
    assert len(MESSAGES) >= 20
    assert len(set(MESSAGES.values())) == len(MESSAGES)

"""Launching training processes from tests, and reading what their runs leave behind.

Every process a test starts belongs to a `Processes`, which a fixture owns (conftest.py: `processes`
for one test, `module_processes` for a module's fixtures): at teardown, passed or failed, whatever
is still running is killed. A process is marked through its environment, which every descendant
inherits (torchrun's workers, which run in sessions of their own, and the group torchrun restarts),
so none is missed, whatever became of its parent.

No test chooses a port: torchrun --standalone binds its rendezvous store to port 0 and hands its
workers a store of its own, gloo binds its own sockets, and spawned test groups meet in a file://
store.
"""

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing import reduction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.infra.faults import FAULT_AT_ENV
from scalevec_train.parallel.process_group import shutdown
from scalevec_train.training.logger import read_records
from tests.support.helpers import REPO, call_main

# Generous: a 4-rank launch on 2 busy cores takes minutes; only a hang gets near this.
TIMEOUT = 600
MARK_ENV = "SCALEVEC_TEST_PROCESS"
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID",
                   "HYDRA_FULL_ERROR", FAULT_AT_ENV, MARK_ENV)


@contextmanager
def gloo_group(store: str, rank: int, world: int) -> Iterator[None]:
    """A gloo process group for a spawned test worker (mp.spawn), meeting in the file `store`. Left
    as the trainer leaves it (parallel.process_group.shutdown): together when the work finished, at
    once when it failed."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    finished = False
    try:
        yield
        finished = True
    finally:
        shutdown(finished)


# What spawned test workers import, imported once by the fork server (spawn()).
WORKER_IMPORTS = ["pytest", "torch", "torch.distributed", "torch.distributed.checkpoint",
                  "torch.distributed.fsdp", "torch.multiprocessing", "scalevec_train.train",
                  "tests.support.launch", "tests.support.train_many"]


def spawn(fn: Callable, args: tuple = (), nprocs: int = 2) -> None:
    """mp.spawn(fn, args, nprocs), each process forked from multiprocessing's fork server, which
    imports WORKER_IMPORTS once per pytest process: a fresh interpreter importing torch and scalevec
    costs some 3 s of CPU per process, a fork a fraction of that. The server is a clean process with
    one thread (no test runs in it), so forking it is safe. Each process gets this process's
    environment, stdout and stderr of now (a forked process would have the server's, from when it
    started). Fails if a process fails, as mp.spawn does."""
    multiprocessing.set_forkserver_preload(WORKER_IMPORTS)
    mp.start_processes(_as_spawned, args=(fn, dict(os.environ), _Stdio(), args), nprocs=nprocs,
                       join=True, start_method="forkserver")


class _Stdio:
    """This process's stdout and stderr, handed to a process spawn() starts (duplicated while it
    starts)."""

    def __init__(self, fds: tuple = ()):
        self.fds = fds

    def __reduce__(self):
        return _Stdio, ((reduction.DupFd(1), reduction.DupFd(2)),)

    def attach(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), self.fds, strict=True):
            os.dup2(fd.detach(), target)


def _as_spawned(rank: int, fn: Callable, env: dict[str, str], stdio: _Stdio, args: tuple) -> None:
    stdio.attach()
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def train_spawned(nprocs: int, runs: list[list[str]], spec: Path,
                  backend: str | None = None) -> None:
    """What `many_command(nprocs, runs, spec)` launches (tests/support/train_many.py), on nprocs
    gloo ranks that spawn() forks rather than torchrun's fresh interpreters. Each rank gets the
    variables torchrun sets (the trainer reads RANK and LOCAL_WORLD_SIZE), and a group that meets in
    a file next to `spec`. `backend`: what distributed.compile compiles with in the ranks, in place
    of inductor (compile_backend)."""
    spec.write_text(json.dumps(runs))
    spawn(_train_many, (nprocs, str(spec.with_suffix(".store")), str(spec), backend), nprocs)


def _train_many(rank: int, world: int, store: str, spec: str, backend: str | None) -> None:
    from tests.support import train_many

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    # process_group.init() then joins nothing: the group exists
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    with compile_backend(backend):
        train_many.main(Path(spec))


@contextmanager
def compile_backend(backend: str | None) -> Iterator[None]:
    """torch.compile with `backend` in place of inductor within the context (None: unchanged).
    "eager": dynamo's capture alone (its graphs, breaks, guards and recompiles); "aot_eager": AOT
    autograd's forward and backward graphs too (as inductor gets them: checkpoint policies, custom
    ops' fake implementations), without code generation, which costs minutes of C++ compilation on a
    fresh machine. Only inductor's own numbers need inductor (tests/parallel/test_compile.py)."""
    if backend is None:
        yield
        return
    compile_ = torch.compile
    torch.compile = partial(compile_, backend=backend)
    try:
        yield
    finally:
        torch.compile = compile_


def child_env(**extra: str) -> dict[str, str]:
    """This environment without launch variables, with the repository importable and one thread per
    process (several processes share few cores)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform == "linux":  # gloo on the loopback device, whatever the host name resolves to
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return {**env, **extra}


def train_in_process(args: list[str], env: dict[str, str], cwd: Path, capfd,
                     monkeypatch) -> tuple[int, str]:
    """`python -m scalevec_train.train <args>` (what train_command(1, ...) starts) in this process:
    Hydra parses sys.argv, main exits with its code, with the environment of a child (no launch
    variables) and `env`; returns that code and what was written to stdout and stderr. What the
    command prints and how it exits is the same here; a process of its own adds seconds of imports,
    and is needed only where a signal or the launch itself is tested."""
    from hydra.core.global_hydra import GlobalHydra

    from scalevec_train.train import main

    capfd.readouterr()
    with monkeypatch.context() as m:
        m.chdir(cwd)
        for key in LAUNCH_ENV_KEYS:
            m.delenv(key, raising=False)
        for key, value in env.items():
            m.setenv(key, value)
        try:
            code = call_main(main, [str(REPO / "scalevec_train" / "train.py"), *args])
        finally:
            GlobalHydra.instance().clear()  # as a new process would find it
    out, err = capfd.readouterr()
    return code, out + err


def torchrun(nproc: int, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", f"--max-restarts={restarts}"]


def train_command(nproc: int, *overrides: str, restarts: int = 0) -> list[str]:
    """python -m scalevec_train.train (1 process, no torchrun) or torchrun with nproc processes."""
    if nproc == 1:
        return [sys.executable, "-m", "scalevec_train.train", *overrides]
    return [*torchrun(nproc, restarts), "-m", "scalevec_train.train", *overrides]


def many_command(nproc: int, runs: list[list[str]], spec: Path) -> list[str]:
    """torchrun with nproc processes training `runs` (lists of overrides) one after the other
    (tests/support/train_many.py); the list is written to `spec`."""
    spec.write_text(json.dumps(runs))
    return [*torchrun(nproc), str(REPO / "tests" / "support" / "train_many.py"), str(spec)]


class Started:
    """A process running in the background; its output goes to a file (no pipe to fill)."""

    def __init__(self, command: list[str], cwd: Path, log: Path, env: dict[str, str]):
        self.command, self.log = command, log
        with log.open("w") as out:
            self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def describe(self) -> str:
        return f"{' '.join(self.command)}\n{self.output()[-6000:]}"

    def wait_until(self, condition: Callable[[], object], what: str, timeout: float = TIMEOUT):
        """Polls `condition` until it returns a true value, and returns that; fails if the process
        ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the process ended before {what}:\n{self.describe()}"
            found = condition()
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout} s:\n{self.describe()}")

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.describe()}") from None


class Processes:
    """The processes of one test or one module's fixtures (see the module docstring)."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.mark = log_dir, uuid.uuid4().hex
        self.started: list[Started] = []

    def start(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> Started:
        log = self.log_dir / f"process{len(self.started)}.log"
        started = Started(command, cwd, log, {**(env or child_env()), MARK_ENV: self.mark})
        self.started.append(started)
        return started

    def run(self, command: list[str], cwd: Path, env: dict[str, str] | None = None,
            code: int = 0) -> str:
        """Runs `command` to its end; fails unless it exits with `code`. Returns its output."""
        started = self.start(command, cwd, env)
        assert started.wait() == code, started.describe()
        return started.output()

    def pids(self, *entries: str) -> list[int]:
        """The live processes carrying this mark (everything started here, and their descendants)
        and the environment `entries` (NAME=value)."""
        wanted = [f"{MARK_ENV}={self.mark}".encode(), *(e.encode() for e in entries)]
        return [pid for pid, env in environments().items() if all(w in env for w in wanted)]

    def worker(self, rank: int) -> int:
        """The pid of the live torchrun worker of `rank` (of the newest group after a restart)."""
        found = self.pids(f"RANK={rank}")
        assert len(found) == 1, f"workers of rank {rank}: {found}"
        return found[0]

    def kill(self) -> None:
        """SIGKILL every process carrying the mark, until none is left (a launcher being killed may
        still start one). The started processes (the launchers) go first: a launcher that outlived
        one of its workers could exit on its own or restart them, whichever order /proc lists the
        pids in."""
        for started in self.started:
            started.proc.kill()
        deadline = time.monotonic() + 30
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for started in self.started:
            started.proc.wait()  # reaped, so that no zombie is left behind
        assert not self.pids(), "processes survived SIGKILL"


class Attempts:
    """Attempts of training runs on `nproc` ranks, each in children forked from the workers of one
    torchrun launch (tests/support/attempts.py): a run can be stopped at a fault point, killed there
    and resumed many times for a fraction of a second of CPU each, where a launch costs seconds."""

    def __init__(self, processes: Processes, folder: Path, nproc: int = 2):
        self.folder, self.nproc, self.count = folder, nproc, 0
        folder.mkdir(parents=True)
        self.started = processes.start(
            [*torchrun(nproc), str(REPO / "tests" / "support" / "attempts.py"), str(folder)],
            folder)

    def run(self, overrides: list[str], fault: str | None = None, kill: str = "all") -> list[int]:
        """One attempt of a run with `overrides`; returns each rank's exit code (negative: the
        signal). `fault`: a stop at a fault point (SCALEVEC_FAULT_AT,
        scalevec_train/infra/faults.py) or a failing write. Once a rank has stopped there, SIGKILL
        that rank (kill="one": the others fail in their next collective with it) or every rank at
        once (kill="all"); fails if no rank ever stops."""
        pids = self.start(overrides, fault)
        if fault is not None and fault.partition("=")[2] in ("", "stop"):

            def stopped() -> list[int]:
                found = [pid for pid in pids if _state(pid) == "T"]
                assert found or None in self.exits(), f"attempt {self.count - 1} ended without " \
                    f"stopping at {fault}: exit codes {self.exits()}\n{self.started.describe()}"
                return found

            found = self.started.wait_until(stopped, f"a stop at {fault}")
            victims = found[:1] if kill == "one" else pids
            # Every rank is stopped before any is killed: a rank still running sees its peer's death
            # in its next collective, fails and is reaped, and would be gone before its own kill.
            for pid in victims:
                os.kill(pid, signal.SIGSTOP)
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
        return self.wait()

    def start(self, overrides: list[str], fault: str | None = None) -> list[int]:
        """Start the next attempt; returns the pids of its processes, in rank order."""
        i, self.count = self.count, self.count + 1
        spec = self.folder / f"{i}.json"
        spec.with_suffix(".tmp").write_text(json.dumps({"overrides": overrides,
                                                        "env": {FAULT_AT_ENV: fault or ""}}))
        spec.with_suffix(".tmp").rename(spec)
        return [self.started.wait_until(lambda r=r: self._read(f"{i}.rank{r}.pid"),
                                        f"attempt {i} started")
                for r in range(self.nproc)]

    def pids_of(self, attempt: int) -> list[int]:
        """The pids of attempt `attempt`'s processes, in rank order."""
        return [self._read(f"{attempt}.rank{r}.pid") for r in range(self.nproc)]

    def exits(self) -> list[int | None]:
        """The exit codes of the latest attempt's processes; None for those still running."""
        return [self._read(f"{self.count - 1}.rank{r}.exit") for r in range(self.nproc)]

    def wait(self) -> list[int]:
        """The exit codes of the latest attempt, once it has ended."""
        self.started.wait_until(lambda: None not in self.exits(),
                                f"the end of attempt {self.count - 1}")
        return self.exits()

    def close(self) -> None:
        """The workers leave once no attempt is left."""
        (self.folder / "done").write_text("")
        assert self.started.wait() == 0, self.started.describe()

    def _read(self, name: str) -> int | None:
        path = self.folder / name
        return int(path.read_text()) if path.exists() else None


def _state(pid: int) -> str | None:
    """The state letter of process `pid` (T: stopped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def environments() -> dict[int, list[bytes]]:
    """The environment (NAME=value entries) of every live process this user may read."""
    out = {}
    for path in Path("/proc").glob("[0-9]*/environ"):
        try:
            out[int(path.parent.name)] = path.read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
    return out


# What a run directory holds.

def records(run_dir: Path) -> list[dict]:
    """The metrics records in file order; a line being written right now (a partial last line) is
    skipped."""
    return read_records(run_dir / "metrics.jsonl")


def curve(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """`key` per step; a resumed run logs steps after its checkpoint again, and the last record
    counts."""
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def latest_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir)), default=-1)


def complete_steps(run_dir: Path) -> list[int]:
    return [checkpoint_files.checkpoint_step(p)
            for p in checkpoint_files.complete_checkpoints(run_dir)]


def copy_run(src: Path, dst: Path, keep_step: int) -> Path:
    """A copy of run `src` whose checkpoints after `keep_step` are left incomplete (marker
    removed)."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > keep_step:
            (ckpt / checkpoint_files.COMPLETE).unlink()
    return dst


def checkpoint_state(ckpt: Path, scratch: Path) -> dict:
    """A DCP checkpoint as one state dict ({"model": ..., "optim": ...}), read in this process."""
    assert (ckpt / checkpoint_files.COMPLETE).is_file(), ckpt
    out = scratch / f"{ckpt.parent.parent.name}-{ckpt.name}-{uuid.uuid4().hex[:6]}.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=True)


def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return {k: v for key, value in items
            for k, v in flat_tensors(value, f"{prefix}/{key}" if prefix else str(key)).items()}


def trained_state(ckpt: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state (moments, step counts); not the learning rate, which the
    schedule sets before every step."""
    state = checkpoint_state(ckpt, scratch)
    return flat_tensors({"model": state["model"], "optim": state["optim"]["state"]})


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def final_model(run_dir: Path, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    return checkpoint_state(checkpoint_files.step_dir(run_dir, step), scratch)["model"]


def newest_whole(run_dir: Path) -> int | None:
    """The step of the checkpoint resume=auto picks; every step_* folder must be complete and whole
    (its files there and long enough), so that no pick can fail."""
    steps = sorted(checkpoint_files.checkpoint_root(run_dir).glob("step_*"))
    for ckpt in steps:
        assert (ckpt / checkpoint_files.COMPLETE).is_file(), f"{ckpt} has no marker"
        checkpoint_files.inspect(ckpt)
    return checkpoint_files.checkpoint_step(steps[-1]) if steps else None


def assert_same_checkpoint(got: Path, expected: Path, scratch: Path) -> None:
    """Parameters, optimizer state and every plain-data state (data position, guard counters, ...)
    bit-identical; the config differs only in what the runs were told (run_dir, keep_last, ...)."""
    assert_identical(trained_state(got, scratch), trained_state(expected, scratch))
    saved, wanted = (checkpoint_files.read_train_state(got),
                     checkpoint_files.read_train_state(expected))
    assert ({k: v for k, v in saved.items() if k != "config"}
            == {k: v for k, v in wanted.items() if k != "config"})


def assert_same_curve(got: dict[int, float], expected: dict[int, float], steps, rel: float = 1e-5,
                      what: str = "loss") -> None:
    """Per-step values against the reference's. rel 1e-5: fp32 sums in another order (over ranks,
    shards and micro-batches) move a loss or norm by about 1e-7 relative per step, and the
    differences grow over a few steps of training; a real difference (one sample, one step) is far
    above."""
    assert sorted(got) == sorted(steps), what
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=rel, abs=0), (what, step)


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        atol: float) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")

"""dev/gpu_session.sh short of a GPU: its dry run checks phase names, budgets and every command's
arguments and prints the one-command plan; a plan past its deadline, its command's timeout or the
files copied back, an unknown phase and a command that would fail at its start are refused.
dev/gpu_phase.py runs each phase: skipped when too little time is left, stopped at its limit or the
deadline, and every process it started ended with it, torchrun-style workers in sessions of their
own included."""

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.helpers import REPO

SCRIPT = REPO / "dev" / "gpu_session.sh"
PHASE = REPO / "dev" / "gpu_phase.py"
# The most files of $OUT that are copied back
FILES_BACK = 8


def session(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SESSION_")}
    return subprocess.run(["bash", str(SCRIPT), *args],
                          env={**full, "PYTHON": sys.executable, **env}, capture_output=True,
                          text=True, cwd=REPO)


def plan(out: str) -> dict:
    """The plan the dry run prints: phases in order with (estimate, limit, min), setup, deadline,
    files, the command's timeout."""
    phases = {m.group(1): tuple(map(int, m.groups()[1:]))
              for m in re.finditer(r"^  (\S+) +(\d+) s +(\d+) s +(\d+) s  \S+  \(estimated",
                                   out, re.M)}
    setup = int(re.search(r"^  setup +(\d+) s", out, re.M).group(1))
    deadline = int(re.search(r"estimates: \d+ s of the (\d+) s deadline", out).group(1))
    files = int(re.search(r"files back: (\d+) of", out).group(1))
    command = int(re.search(r"under a timeout of (\d+) s", out).group(1))
    return {"phases": phases, "setup": setup, "deadline": deadline, "files": files,
            "command": command}


def test_the_default_plan_is_one_command_in_the_issues_order_that_fits_its_deadline():
    done = session("--dry-run")
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: wheels missing, nothing else
    if done.returncode:
        assert "wheels: .whl/ lacks" in done.stdout
        assert "bash ../shared/tools/gpu-wheels.sh $(cat dev/gpu_wheels.txt)" in done.stdout
    p = plan(done.stdout)
    # issue 49's order: the kernels, dense-1b compiled with kernels auto, then triton and torch
    # alone, moe-2b with a profile, tests/gpu, torchtitan
    assert list(p["phases"]) == ["kernels", "train-1b", "train-1b-kernels", "moe-2b", "gpu-tests",
                                 "torchtitan"]
    assert p["setup"] + sum(est for est, _, _ in p["phases"].values()) <= p["deadline"]
    assert all(minimum <= est <= limit for est, limit, minimum in p["phases"].values())
    assert p["deadline"] + p["setup"] <= p["command"] <= 600  # a command of at most 10 minutes
    assert p["files"] <= FILES_BACK
    checked = done.stdout.split("commands:")[1]
    # train-1b-kernels: triton, then torch
    assert checked.count("  ok  ") == 7 and "FAIL" not in checked
    assert "2 run config(s) compose: dense-1b baseline, dense-1b unified" in checked
    assert "model.kernels=triton" in checked and "model.kernels=torch" in checked
    assert "2 run config(s) compose: moe-2b baseline, moe-2b unified" in checked


def test_the_fp8_phase_is_a_command_of_its_own_that_fits_the_deadline():
    """dense-1b in bf16, tensorwise and rowwise, then model.fp8's GEMM table of dense-0.5b/1b/2b;
    beside even the default plan's first two phases it would pass the deadline, so it runs alone."""
    done = session("--dry-run", "fp8")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    p = plan(done.stdout)
    assert list(p["phases"]) == ["fp8"]
    assert p["setup"] + p["phases"]["fp8"][0] <= p["deadline"]
    assert all(minimum <= est <= limit for est, limit, minimum in p["phases"].values())
    checked = done.stdout.split("commands:")[1]
    assert checked.count("  ok  ") == 4 and "FAIL" not in checked
    assert "3 preset(s) compose: dense-0.5b, dense-1b, dense-2b" in checked
    for fp8 in ("none", "tensorwise", "rowwise"):
        assert f"--micro-batch 4 -- model.fp8={fp8}\n        arguments parse; 2 run config(s) " \
               "compose: dense-1b baseline, dense-1b unified" in checked
    beside = session("--dry-run", "kernels", "train-1b", "fp8")
    assert (beside.returncode == 2
            and "add up to 580 s with the setup, over the deadline of 515 s" in beside.stderr)


@pytest.mark.parametrize("args,env,problem", [
    (["kernels"], {"GPU_SESSION_DEADLINE": "530"}, "exceed the command's timeout of 540 s"),
    (["kernels", "train-1b", "gpu-tests"], {"GPU_SESSION_DEADLINE": "200"},
     "the phases' estimates add up to 280 s with the setup, over the deadline of 200 s"),
    (["kernels", "train-1b", "gpu-tests", "torchtitan", "train-1b-eager", "muon", "train-2b"], {},
     "these phases write 9 files"),
    (["kernels"], {"GPU_SESSION_LIMIT_KERNELS": "2m"}, "the limit of kernels is '2m'"),
    (["kernels", "no-such-phase"], {}, "unknown phase 'no-such-phase'")])
def test_a_plan_over_budget_is_refused_before_anything_runs(tmp_path, args, env, problem):
    for dry in (["--dry-run"], []):
        done = session(*dry, *args, OUT=str(tmp_path), **env)
        assert done.returncode == 2 and problem in done.stderr, done.stderr
        assert "commands:" not in done.stdout and not any(tmp_path.iterdir())


def test_the_checker_names_a_command_that_would_fail_at_its_start():
    lines = [["python3", "scripts/bench_train.py", "--presets", "dense-1b,dense-9b"],
             ["python3", "scripts/bench_train.py", "--presets", "dense-1b", "--", "optim.lr=-1"],
             ["python3", "scripts/bench_kernels.py", "--against", "nothing"],
             ["python3", "scripts/bench_nothing.py"],
             ["python3", "scripts/bench_kernels.py", "--ops", "rms_norm", "--against", "eager"]]
    done = subprocess.run([sys.executable, str(REPO / "dev" / "gpu_session_check.py")], cwd=REPO,
                          input="\n".join(shlex.join(w) for w in lines), capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}"})
    assert done.returncode == 1, done.stderr
    verdicts = re.findall(r"^  (ok|FAIL)  ", done.stdout, re.M)
    assert verdicts == ["FAIL", "FAIL", "FAIL", "FAIL", "ok"], done.stdout
    assert "dense-9b" in done.stdout and "optim.lr" in done.stdout
    assert ("invalid choice: 'nothing'" in done.stdout
            and "bench_nothing.py does not exist" in done.stdout)


def phase(tmp_path: Path, script: str, *, limit: float, minimum: float = 0,
          deadline: float | None = None, grace: float = 2) -> tuple[int, str, str]:
    """Run `script` (Python) as a phase: (exit status, its log, the report's line)."""
    log, report = tmp_path / "phase.log", tmp_path / "session.txt"
    cmd = [sys.executable, str(PHASE), "--name", "demo", "--limit", str(limit), "--min",
           str(minimum), "--grace", str(grace), "--log", str(log), "--report", str(report),
           "--note", " estimate=1s"]
    if deadline is not None:
        cmd += ["--deadline", str(deadline)]
    done = subprocess.run([*cmd, "--", sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=60)
    return done.returncode, log.read_text() if log.exists() else "", report.read_text()


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie, exited and waiting for its parent to reap it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# A phase whose child starts a worker in a process session of its own, as torchrun does, writes the
# worker's pid, then waits (or exits at once with `leave`).
WORKER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                          start_new_session=True)
open({pidfile!r}, "w").write(str(worker.pid))
print("worker started", flush=True)
{rest}
"""


# The phase that exits by itself has a limit it never reaches (its wall time is its own); the one
# stopped at its limit must have started its worker within those 3 s.
@pytest.mark.parametrize("rest,limit,want_rc,running",
                         [("time.sleep(120)", 3, 124, 2), ("sys.exit(3)", 20, 3, 1)],
                         ids=["stopped-at-its-limit", "exits-leaving-a-worker"])
def test_a_phase_ends_every_process_it_started(tmp_path, rest, limit, want_rc, running):
    pidfile = tmp_path / "worker.pid"
    start = time.monotonic()
    rc, log, report = phase(tmp_path, WORKER.format(pidfile=str(pidfile), rest=rest), limit=limit)
    worker = int(pidfile.read_text())
    assert rc == want_rc and not alive(worker)
    assert time.monotonic() - start < 30  # not waiting for the worker's 120 s
    assert log.startswith("$ ") and "worker started" in log
    # at the limit: the command and its worker; after the command's exit: the worker it left behind
    assert re.search(rf"rc={want_rc} wall=\d+s limit={limit}s ended {running} process\(es\) still "
                     r"running$", log.strip())
    assert re.fullmatch(rf"demo +rc={want_rc} +wall= +\d+s limit={limit}s estimate=1s\n", report)


def test_a_phase_is_capped_by_the_deadline_and_skipped_when_too_little_is_left(tmp_path):
    """Decided by what the phase did, not by how long the processes took to start: a start-up delay
    only shortens the time left (the phase starts with at most 6 s to the deadline, less 3 s of
    grace)."""
    rc, log, report = phase(tmp_path, "import time; time.sleep(120)", limit=100,
                            deadline=time.time() + 6, grace=3)
    limit = int(re.fullmatch(r"demo +rc=124 +wall= +\d+s limit=(\d+)s estimate=1s\n",
                             report).group(1))
    assert rc == 124 and limit <= 3  # cut at the deadline less the grace, not at its own 100 s
    # its log kept: the command, then the status line with the limit it ran under and the process it
    # cut
    assert log.startswith("$ ")
    assert re.search(rf"\nrc=124 wall=\d+s limit={limit}s ended 1 process\(es\) still running$",
                     log.strip())
    (tmp_path / "phase.log").unlink()
    rc, log, report = phase(tmp_path, "print('ran')", limit=100, minimum=30,
                            deadline=time.time() + 20)
    assert rc == 125 and log == ""  # never started: no log
    left = re.fullmatch(r"demo +skipped: (\d+)s left before the deadline, it needs 30s estimate=1s",
                        report.splitlines()[-1]).group(1)
    assert int(left) <= 18  # 20 s to the deadline, less the grace of 2 s

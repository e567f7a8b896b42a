"""scripts/gpu_session.sh short of a GPU: its dry run checks phase names, budgets and every command's
arguments and prints the plan with each call's worst case; a plan over the device tool's limits, an
unknown phase and a command that would fail at its start are refused. scripts/gpu_session_check.py is
the dry run's checker of commands."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "gpu_session.sh"
CALL_S, SESSION_S = 600, 1800


def session(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SESSION_LIMIT_")}
    return subprocess.run(["bash", str(SCRIPT), *args], env={**full, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, cwd=REPO)


def plan(out: str) -> list[dict]:
    """The calls the dry run prints: each call's phases with their limits, setup and worst case."""
    calls = []
    for line in out.splitlines():
        if m := re.match(r"call \d+: bash scripts/gpu_session.sh (.+)", line):
            calls.append({"phases": m.group(1).split(), "limits": {}})
        elif m := re.match(r"  (\S+(?: case)?) +(\d+) s(?:  \(\+(\d+) s to stop it\))?", line):
            name, seconds, grace = m.group(1), int(m.group(2)), m.group(3)
            if name == "setup":
                calls[-1]["setup"] = seconds
            elif name == "worst case":
                calls[-1]["worst"] = seconds
            else:
                calls[-1]["limits"][name] = seconds + int(grace)
    return calls


def test_dry_run_checks_one_call_and_prints_its_worst_case():
    done = session("--dry-run", "kernels", "train-1b", GPU_SESSION_LIMIT_KERNELS="100")
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: wheels missing, nothing else
    if done.returncode:
        assert "wheels: .whl/ lacks" in done.stdout
        assert "bash ../shared/tools/gpu-wheels.sh $(cat scripts/gpu_wheels.txt)" in done.stdout
    else:
        assert "wheels: .whl/ holds the 9" in done.stdout
    [call] = plan(done.stdout)
    assert call["phases"] == ["kernels", "train-1b"] and call["limits"]["kernels"] == 100 + 10
    assert call["worst"] == call["setup"] + sum(call["limits"].values()) <= CALL_S
    checked = done.stdout.split("commands:")[1]
    assert checked.count("  ok  ") == 2 and "FAIL" not in checked
    assert "2 run config(s) compose: dense-1b baseline, dense-1b unified" in checked


def test_the_plan_fits_the_session_and_the_first_call_brings_the_headline_numbers():
    done = session("--dry-run", "no-such-phase")  # names are checked before anything else
    assert done.returncode == 2 and "unknown phase 'no-such-phase'" in done.stderr
    text = SCRIPT.read_text()
    calls = [c.split() for c in re.search(r"^CALLS=\((.*)\)$", text, re.M).group(1).strip('"').split('" "')]
    limits = {k: int(v) for k, v in re.findall(r"\[([a-z0-9-]+)\]=(\d+)", text.split("declare -A LOG")[0])}
    consts = {k: int(v) for k, v in re.findall(r"(\w+_S)=(\d+)", text)}
    worst = [consts["SETUP_S"] + sum(limits[p] + consts["KILL_S"] for p in c) for c in calls]
    assert calls[0][:2] == ["kernels", "train-1b"] and calls[-1][-1] == "suite"
    assert sorted(p for c in calls for p in c) == sorted(limits)
    assert max(worst) <= CALL_S
    assert consts["START_S"] + sum(worst) + len(calls) * consts["TRANSFER_S"] <= SESSION_S


@pytest.mark.parametrize("env,problem", [
    ({"GPU_SESSION_LIMIT_TRAIN_1B": "500"}, "call 1 (kernels train-1b kernels-compile) takes up to 830 s, over "
                                            "the device tool's 600 s per command"),
    ({"GPU_SESSION_LIMIT_TORCHTITAN": "360"}, "the plan takes up to 1875 s of device time, over the session's "
                                              "1800 s"),
    ({"GPU_SESSION_LIMIT_SUITE": "2m"}, "the limit of suite is '2m'")])
def test_a_plan_over_budget_is_refused(env, problem):
    done = session("--dry-run", **env)
    assert done.returncode == 2 and problem in done.stderr, done.stderr
    assert "commands:" not in done.stdout  # refused before any command is checked


def test_a_real_call_over_a_device_command_is_refused_before_it_starts(tmp_path):
    done = session("kernels", "train-1b", "kernels-compile", "torchtitan", OUT=str(tmp_path))
    assert done.returncode == 2 and "over the device tool's 600 s per command" in done.stderr
    assert not any(tmp_path.iterdir())


def test_the_checker_names_a_command_that_would_fail_at_its_start():
    lines = [["python3", "scripts/bench_train.py", "--presets", "dense-1b,dense-9b"],
             ["python3", "scripts/bench_train.py", "--presets", "dense-1b", "--", "optim.lr=-1"],
             ["python3", "scripts/bench_kernels.py", "--against", "nothing"],
             ["python3", "scripts/bench_nothing.py"],
             ["python3", "scripts/bench_kernels.py", "--ops", "rms_norm", "--against", "eager"]]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_session_check.py")], cwd=REPO,
                          input="\n".join(shlex.join(w) for w in lines), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}"})
    assert done.returncode == 1, done.stderr
    verdicts = re.findall(r"^  (ok|FAIL)  ", done.stdout, re.M)
    assert verdicts == ["FAIL", "FAIL", "FAIL", "FAIL", "ok"], done.stdout
    assert "dense-9b" in done.stdout and "optim.lr" in done.stdout
    assert "invalid choice: 'nothing'" in done.stdout and "bench_nothing.py does not exist" in done.stdout

"""Checks the commands of the GPU plan without a GPU (dev/gpu_session.sh --dry-run runs it): that
each would get past its start on the GPU host.

Reads one command a line on stdin, shell-quoted (`env VAR=VALUE ...` in front allowed), and checks
  scripts/bench_kernels.py      its arguments, by the script's own parser
  scripts/bench_train.py        its arguments, and the config of every (preset, scale) run composed
                                and validated as the script will compose it (world size 1)
  scripts/bench_fp8.py          its arguments, and every preset composed under model.fp8
  scripts/bench_torchtitan.py   its arguments, the bench_train.py command it runs (as above), and,
                                where torchtitan is installed, its torchtitan arguments by
                                torchtitan's parser
  -m pytest ...                 the same pytest arguments collecting without error, with the import
                                names of --host-lacks hidden (tests/support/hide_packages.py), as on
                                the GPU host
Prints one line per command; exits 1 if any would fail.

    python dev/gpu_session_check.py --host-lacks "datasets wandb" < commands
"""

import argparse
import contextlib
import importlib.util
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class CheckFailed(Exception):
    pass


def script(name: str) -> dict:
    """A script's globals, its main() not run."""
    return runpy.run_path(str(ROOT / "scripts" / name),
                          run_name=f"gpu_session_check.{Path(name).stem}")


def parse(module: dict, argv: list[str]):
    """The script's parsed arguments; its parser's own message when they do not parse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return module["parse_args"](argv)
    except SystemExit:
        raise CheckFailed(err.getvalue().strip().splitlines()[-1]) from None


def check_bench_kernels(argv: list[str]) -> str:
    args = parse(script("bench_kernels.py"), argv)
    return f"arguments parse ({', '.join(args.ops)}; fused against {', '.join(args.against)})"


def check_bench_fp8(argv: list[str]) -> str:
    from hydra.errors import HydraException

    from scalevec_train.config import compose_config
    from scalevec_train.infra.errors import ScalevecError

    args = parse(script("bench_fp8.py"), argv)
    presets = args.presets.split(",")
    for preset in presets:
        try:
            compose_config([f"model={preset}", "model.fp8=tensorwise"], 1)
        except (ScalevecError, HydraException) as e:
            raise CheckFailed(f"{preset}: {str(e).splitlines()[0]}") from None
    return f"arguments parse; {len(presets)} preset(s) compose: {', '.join(presets)}"


def check_bench_train(argv: list[str]) -> str:
    from hydra.errors import HydraException

    from scalevec_train.config import compose_config
    from scalevec_train.infra.errors import ScalevecError

    bench = script("bench_train.py")
    args = parse(bench, argv)
    pairs = bench["pairs"](args)
    for preset, scale in pairs:
        try:
            compose_config(bench["run_overrides"](preset, scale, args, 1, tempfile.gettempdir()), 1)
        except (ScalevecError, HydraException) as e:  # a bad value; an unknown preset or key
            raise CheckFailed(f"{preset} {scale}: {str(e).splitlines()[0]}") from None
    return (f"arguments parse; {len(pairs)} run config(s) compose: "
            f"{', '.join(' '.join(p) for p in pairs)}")


def check_bench_torchtitan(argv: list[str]) -> str:
    bench = script("bench_torchtitan.py")
    args = parse(bench, argv)
    ours = check_bench_train(bench["scalevec_argv"](args))
    if importlib.util.find_spec("torchtitan") is None:
        return (f"arguments parse; its bench_train.py: {ours}; torchtitan not installed here, its "
                "arguments unchecked")
    from torchtitan.config import ConfigManager

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ConfigManager().parse_args(bench["torchtitan_argv"](args, tempfile.gettempdir()))
    except SystemExit:
        raise CheckFailed(f"torchtitan rejects its arguments: {err.getvalue().strip()}") from None
    return f"arguments parse, torchtitan's too; its bench_train.py: {ours}"


def check_pytest(argv: list[str], env: dict, host_lacks: str) -> str:
    env = {**os.environ, **env, "SCALEVEC_HIDE_PACKAGES": host_lacks}
    cmd = [sys.executable, "-m", "pytest", *argv, "--collect-only", "-n", "0", "-p",
           "tests.support.hide_packages"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode:
        raise CheckFailed(f"collection fails (exit {done.returncode}): " + " | ".join(lines[-5:]))
    # under -qq
    per_file = [int(m.group(1)) for line in lines if (m := re.fullmatch(r".+\.py: (\d+)", line))]
    found = (f"{sum(per_file)} tests in {len(per_file)} files" if per_file
             else (lines[-1] if lines else ""))
    return f"collects with {host_lacks} hidden: {found}"


def check(line: str, host_lacks: str) -> str:
    words = shlex.split(line)
    env = {}
    if words[0] == "env":
        words.pop(0)
        while "=" in words[0]:
            key, value = words.pop(0).split("=", 1)
            env[key] = value
    argv = words[1:]  # the interpreter dropped
    if argv[:2] == ["-m", "pytest"]:
        return check_pytest(argv[2:], env, host_lacks)
    checks = {"bench_kernels.py": check_bench_kernels, "bench_train.py": check_bench_train,
              "bench_torchtitan.py": check_bench_torchtitan, "bench_fp8.py": check_bench_fp8}
    name = Path(argv[0]).name
    if not (ROOT / argv[0]).is_file():
        raise CheckFailed(f"{argv[0]} does not exist")
    if name not in checks:
        raise CheckFailed(f"no check for {argv[0]}: add one to dev/gpu_session_check.py")
    return checks[name](argv[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host-lacks", default="",
                   help="import names the GPU host lacks, space-separated")
    args = p.parse_args()
    failed = 0
    for line in filter(str.strip, sys.stdin.read().splitlines()):
        shown = " ".join(shlex.split(line)[:12])
        try:
            print(f"  ok    {shown}\n        {check(line, args.host_lacks)}", flush=True)
        except Exception as e:  # noqa: BLE001  (any error at the start is this command's failure)
            failed += 1
            why = (e if isinstance(e, CheckFailed)
                   else f"{type(e).__name__}: {str(e).splitlines()[0]}")
            print(f"  FAIL  {shown}\n        {why}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

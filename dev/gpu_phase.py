"""Run one phase of the GPU plan (dev/gpu_session.sh) under its limit and the plan's deadline, and
end every process it started, wherever it went.

The phase runs for at most --limit seconds or until --grace seconds before the --deadline (a Unix
time), whichever comes first; when less than --min seconds would be left for it, it is skipped.
`timeout` kills a process group, but torchrun starts its workers in process sessions of their own: a
worker outlives a killed torchrun and goes on holding GPU memory that the next phase needs. So every
process of the phase carries a tag in its environment (inherited through fork, exec, setsid and
torchrun alike), and when the phase ends, by itself or at its limit, every process that carries the
tag is sent SIGTERM, then SIGKILL after the grace period.

    python dev/gpu_phase.py --name kernels --limit 120 --min 30 --deadline 1790000000 \
        --log out/kernels.md --report out/session.txt -- python3 scripts/bench_kernels.py ...

The command's output goes to --log, which starts with the command line and ends with a status line
(`rc=... wall=...s limit=...s`, plus how many of its processes were still running and ended);
--report gets one line per phase, run or skipped. Exits with the command's status, 124 when the
limit stopped it (as `timeout` does), or 125 when it was skipped.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

TAG = "SCALEVEC_GPU_PHASE"


def tagged(tag: str) -> list[int]:
    """The pids of live processes whose environment holds TAG=tag (only those this user may
    read)."""
    needle = f"{TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and not zombie(entry):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


def zombie(entry: Path) -> bool:
    """A zombie has exited and holds nothing: only its parent's wait can remove it."""
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def end_all(tag: str, grace: float) -> int:
    """SIGTERM to every tagged process, SIGKILL to those still alive after `grace` seconds; their
    count."""
    pids = tagged(tag)
    for pid in pids:
        with_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (alive := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        with_signal(pid, signal.SIGKILL)
    while tagged(tag) and time.monotonic() < deadline + 5:
        time.sleep(0.1)
    return len(pids)


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


SKIPPED = 125


def run(cmd: list[str], limit: float, grace: float, log: Path) -> int:
    """Run cmd for at most `limit` seconds, its output in `log`; then end every process it left."""
    tag = uuid.uuid4().hex
    start = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, TAG: tag}, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            rc = 124
        ended = end_all(tag, grace)
        if proc.poll() is None:  # its environment unreadable: its process group at least
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        f.write(f"rc={rc} wall={time.monotonic() - start:.0f}s limit={limit:.0f}s"
                + (f" ended {ended} process(es) still running" if ended else "") + "\n")
    return rc


def phase(args: argparse.Namespace) -> int:
    """Run or skip the phase by the time left before the deadline; one line about it in the
    report."""
    left = args.deadline - time.time() - args.grace
    if left < args.min:
        rc, line = SKIPPED, (f"skipped: {max(0, left):.0f}s left before the deadline, it needs "
                             f"{args.min:.0f}s")
    else:
        limit = min(args.limit, left)
        start = time.monotonic()
        rc = run(args.cmd, limit, args.grace, args.log)
        line = f"rc={rc:<3} wall={time.monotonic() - start:4.0f}s limit={limit:.0f}s"
    with open(args.report, "a") as f:
        f.write(f"{args.name:<16} {line}{args.note}\n")
    return rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the phase's name, for the report")
    p.add_argument("--limit", type=float, required=True, help="seconds the command may run")
    p.add_argument("--min", type=float, default=0,
                   help="the least time worth starting it with, seconds")
    p.add_argument("--deadline", type=float, default=float("inf"),
                   help="the plan's deadline, a Unix time")
    p.add_argument("--grace", type=float, default=10, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log", type=Path, required=True, help="file for the command's output")
    p.add_argument("--report", type=Path, required=True,
                   help="file that gets one line about the phase")
    p.add_argument("--note", default="",
                   help="appended to the report's line (e.g. the phase's estimate)")
    p.add_argument("cmd", nargs="+", help="the command, after --")
    sys.exit(phase(p.parse_args()))


if __name__ == "__main__":
    main()

"""Do 2-rank runs leave cleanly, every time? Launches many short `torchrun --nproc_per_node=2` runs
of scalevec_train.train (gloo on the CPU) and counts how each rank exited
(docs/guides/reliability.md, "Leaving cleanly").

    python dev/exit_soak.py --launches 200 --out /tmp/exit_soak     # both cores kept busy beside it

Cases, taken in turn: `adamw` (a finished dense run), `muon` (a finished Muon run with unified
scales, whose optimizer talks over FSDP's mesh), `async` (checkpoints written in the background over
their own gloo group), `sigterm` (rank 1 gets SIGTERM once training has logged a step: both ranks
save and exit 0) `diverged` (injected NaN losses stop both ranks with exit code 3; torchrun then
SIGTERMs a rank still leaving when the other has exited), and `mesh`: this script as the worker
(--leave), what a run does with the group in a few lines (a DTensor on a mesh, which torch's caches
keep, a last all-reduce, then leaving as the trainer leaves), which reaches the exit seconds after
starting. A launch is clean when every rank exits with its case's code; an abort is a rank killed by
SIGABRT (exit code -6, "terminate called ..."). The launches of a case that were not clean keep
their folder under --out (torchrun's output and, with --cores, the core files of aborted ranks);
clean ones are deleted. --hog N starts N busy processes beside the launches (default: one per core),
because the abort showed under load.
"""

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds; a launch takes about 15 on 2 busy cores, only a hang gets near this
TINY = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
        "model.n_layers=2", "model.vocab_size=512", "train.seq_len=32", "train.global_batch=4",
        "train.micro_batch=2", "train.eval_batches=1", "train.eval_every=0",
        "schedule.warmup_steps=1", "device=cpu", "data.num_workers=1", "logger.progress_bar=false",
        "train.log_every=3"]
# case -> (overrides, environment, the exit code of every rank)
CASES = {
    "adamw": (["train.steps=6"], {}, 0),
    "muon": (["train.steps=6", "optim=muon", "scale=unified"], {}, 0),
    "async": (["train.steps=6", "checkpoint.every=2", "checkpoint.async_save=true"], {}, 0),
    "sigterm": (["train.steps=1000000", "schedule=constant", "optim=muon"], {}, 0),
    "diverged": (["train.steps=12", "train.max_bad_steps=2", "train.log_every=1"],
                 {"SCALEVEC_FAULT_AT": "step.loss:2=nan,step.loss:3=nan"}, 3),
    "mesh": (None, {}, 0),
}
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """As tests/support/launch.py's: no launch variables inherited, the checkout importable, one
    thread per process, gloo on the loopback device."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **extra}


def descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker(launcher: int, rank: int) -> int | None:
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return pid
    return None


def logged_a_step(run_dir: Path) -> bool:
    try:
        return any("loss" in json.loads(line)
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if line.endswith("}"))
    except OSError:
        return False


def launch(case: str, folder: Path, data: list[str], cores: bool) -> tuple[str, str]:
    """Runs one launch in `folder`; returns its outcome (clean, abort, hang or other) and its
    output."""
    overrides, extra, expected = CASES[case]
    folder.mkdir(parents=True)
    log = folder / "torchrun.log"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if overrides is None:
        command = [*torchrun, __file__, "--leave"]
    else:
        command = [*torchrun, "-m", "scalevec_train.train", *TINY, *data, *overrides,
                   f"run_dir={folder / 'run'}"]

    def allow_cores():
        if cores:
            resource.setrlimit(resource.RLIMIT_CORE,
                               (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=folder, env=child_env(extra), stdout=out,
                                stderr=subprocess.STDOUT,
                                preexec_fn=allow_cores, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT
    if case == "sigterm":
        while (proc.poll() is None and time.monotonic() < deadline
                and not logged_a_step(folder / "run")):
            time.sleep(0.05)
        pid = worker(proc.pid, 1)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "hang", log.read_text(errors="replace")
    output = log.read_text(errors="replace")
    codes = [int(c) for c in EXITCODE.findall(output)]
    if -signal.SIGABRT in codes or "terminate called" in output:
        return "abort", output
    # a rank that exits non-zero first makes torchrun SIGTERM the other, which may still be leaving
    clean = ((rc == 0 and not codes) if expected == 0
             else (expected in codes and set(codes) <= {expected, -15}))
    if case == "sigterm":
        clean = clean and "stopped by SIGTERM" in output
    return ("clean" if clean else "other"), output


def leave_after_a_dtensor() -> None:
    """The `mesh` case's worker."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from scalevec_train.parallel import process_group

    process_group.init()
    mesh = init_device_mesh("cpu", (process_group.world_size(),))
    # the redistribution is cached
    distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).full_tensor()
    del mesh
    process_group.all_reduce_sum(torch.ones(3))
    process_group.shutdown(finished=True)


def hog(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> int:
    if sys.argv[1:] == ["--leave"]:
        leave_after_a_dtensor()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, taken in turn")
    parser.add_argument("--hog", type=int, default=os.cpu_count(),
                        help="busy processes beside the launches")
    parser.add_argument("--out", type=Path, required=True,
                        help="folders of launches that were not clean")
    parser.add_argument("--data-cache", type=Path, default=ROOT / "data_cache")
    parser.add_argument("--cores", action="store_true", help="let aborted ranks write core files")
    args = parser.parse_args()
    cases = args.cases.split(",")
    data = ["data=stdlib", f"data.cache_dir={args.data_cache}"]
    # once, here: otherwise the first launch's two ranks would prepare the data at the same time
    subprocess.run([sys.executable, "-m", "scalevec_train.prepare_data", *data,
                    "model.vocab_size=512"],
                   env=child_env({}), check=True, stdout=subprocess.DEVNULL)
    args.out.mkdir(parents=True, exist_ok=True)
    # through the finally below: the hogs end too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    hogs = hog(args.hog)
    counts: dict[str, Counter] = {case: Counter() for case in cases}
    started = time.monotonic()
    try:
        for i in range(args.launches):
            case = cases[i % len(cases)]
            folder = args.out / f"{i:04d}-{case}"
            outcome, output = launch(case, folder, data, args.cores)
            counts[case][outcome] += 1
            if outcome == "clean":
                shutil.rmtree(folder)
            else:
                tail = "\n    ".join(output.strip().splitlines()[-8:])
                print(f"launch {i} ({case}): {outcome}, kept in {folder}\n    {tail}", flush=True)
            if (i + 1) % 10 == 0:
                print(f"{i + 1} launches, {time.monotonic() - started:.0f} s: {dict(counts)}",
                      flush=True)
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    total = sum(counts.values(), Counter())
    for case in cases:
        print(f"{case}: {sum(counts[case].values())} launches, {dict(counts[case])}")
    print(f"all: {args.launches} launches, {total['abort']} aborts, {total['hang']} hangs, "
          f"{total['other']} other failures, {time.monotonic() - started:.0f} s")
    return 0 if total["clean"] == args.launches else 1


if __name__ == "__main__":
    sys.exit(main())

"""Kills at random moments: the longer, randomized companion of tests/training/test_faults.py
(docs/guides/reliability.md, "Kills at any moment").

    python dev/kill_soak.py --kills 300 --out /tmp/kill_soak

Trains 2-rank runs (gloo on the CPU; attempts forked from one torchrun launch,
tests/support/attempts.py), with synchronous and asynchronous saves in turn, and kills every
attempt, with SIGKILL to one rank or to both: at a fault point drawn at random (any point of
scalevec_train/infra/faults.py, at any step the attempt still reaches, on a rank that reaches it),
or blindly after a random delay. Every attempt resumes with resume=auto. After each kill, every
checkpoint resume=auto may pick must be whole; after --per-run kills the run is trained to its end,
which must be bit-identical (parameters, optimizer state, data position, guard counters) to the
uninterrupted run. Prints the counts; the folders of failed runs stay in --out.
"""

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalevec_train.infra.errors import ScalevecError  # noqa: E402
from scalevec_train.infra.faults import POINTS  # noqa: E402
from tests.support.launch import (  # noqa: E402
    Attempts,
    Processes,
    assert_same_checkpoint,
    child_env,
    newest_whole,
)

STEPS, EVERY = 12, 2
RUN = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=64",
       "model.n_layers=2", "model.vocab_size=512", "train.seq_len=32", "train.global_batch=4",
       "train.micro_batch=2", "train.eval_batches=1", "train.eval_every=0", "schedule=constant",
       "schedule.warmup_steps=1", "device=cpu", "logger.progress_bar=false", "train.log_every=1",
       f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep_last=1"]
SURVIVOR_TIMEOUT = 10  # seconds for a rank whose peer was killed to fail in its next collective
RANK0_POINTS = {name for name, where in POINTS.items() if where.startswith("rank 0")}


def random_fault(rng: random.Random, newest: int) -> str:
    """A stop at a point the next attempt reaches: it resumes after step `newest` and runs to
    STEPS."""
    point = rng.choice(sorted(POINTS))
    steps = range(newest + 1, STEPS + 1)
    if point.startswith("save."):
        steps = [s for s in steps if s % EVERY == 0 or s == STEPS]
    rank = 0 if point in RANK0_POINTS else rng.randrange(2)
    return f"{point}:{rng.choice(steps)}@{rank}"


def kill_blindly(attempts: Attempts, overrides: list[str], delay: float, kill: str,
                 rng: random.Random) -> str:
    """Start an attempt and SIGKILL one or both of its ranks after `delay` seconds. Returns
    "finished" if it finished first; "killed"; or "ended by the launcher" when one rank was killed
    before the process group was formed (the other then waits for it to join: torchrun ends it, so
    this does)."""
    pids = attempts.start(overrides)
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline and None in attempts.exits():
        time.sleep(0.01)
    if None not in attempts.exits():
        return "finished"
    for pid in [rng.choice(pids)] if kill == "one" else pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just now
            pass
    deadline = time.monotonic() + SURVIVOR_TIMEOUT
    while time.monotonic() < deadline and None in attempts.exits():
        time.sleep(0.05)
    if None not in attempts.exits():
        return "killed"
    for pid, code in zip(pids, attempts.exits(), strict=True):
        if code is None:
            os.kill(pid, signal.SIGKILL)
    attempts.wait()
    return "ended by the launcher"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=300)
    parser.add_argument("--per-run", type=int, default=8,
                        help="kills before a run is trained to its end")
    parser.add_argument("--blind", type=float, default=0.3,
                        help="share of kills after a random delay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-cache", type=Path, default=ROOT / "data_cache")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    data = ["data=stdlib", f"data.cache_dir={args.data_cache}", "model.vocab_size=512"]
    subprocess.run([sys.executable, "-m", "scalevec_train.prepare_data", *data], env=child_env(),
                   check=True, stdout=subprocess.DEVNULL)
    args.out.mkdir(parents=True, exist_ok=True)
    processes = Processes(args.out)
    # through the finally below: every process ends
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    counts, failures = Counter(), []
    started = time.monotonic()
    try:
        attempts = Attempts(processes, args.out / "attempts")
        reference = args.out / "reference"
        # the second is timed: the workers have what a run imports
        for copy in ("warm-up", "reference"):
            whole = time.monotonic()
            assert attempts.run([*data, *RUN, f"run_dir={args.out / copy}"]) == [0, 0]
            whole = time.monotonic() - whole  # a blind kill lands within the time of a whole run
        run = 0
        while counts["kills"] < args.kills:
            mode = ["sync", "async"][run % 2]
            run_dir = args.out / f"run{run:03d}-{mode}"
            overrides = [*data, *RUN, f"checkpoint.async_save={mode == 'async'}",
                         f"run_dir={run_dir}", "resume=auto"]
            try:
                for _ in range(min(args.per_run, args.kills - counts["kills"])):
                    newest = newest_whole(run_dir) or 0
                    if newest == STEPS:  # killed after its last checkpoint was complete
                        break
                    kill = rng.choice(["one", "all"])
                    if rng.random() < args.blind:
                        outcome = kill_blindly(attempts, overrides, rng.uniform(0, whole),
                                               kill, rng)
                        if outcome == "finished":
                            counts["blind kills that came after the end"] += 1
                            break
                        counts[f"{mode} blind, {kill}"
                               + ("" if outcome == "killed" else f", {outcome}")] += 1
                    else:
                        fault = random_fault(rng, newest)
                        attempts.run(overrides, fault, kill)
                        counts[f"{mode} {fault.split(':')[0]}, {kill}"] += 1
                    counts["kills"] += 1
                newest_whole(run_dir)
                if attempts.exits() != [0, 0]:  # the last attempt was killed: train to the end
                    assert attempts.run(overrides) == [0, 0], "the resume to the end failed"
                assert_same_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:06d}",
                                       reference / "checkpoints" / f"step_{STEPS:06d}", args.out)
                counts["runs bit-identical to the uninterrupted one"] += 1
                shutil.rmtree(run_dir)
            # a damaged checkpoint, a failed resume, a difference
            except (AssertionError, ScalevecError) as e:
                failures.append(f"{run_dir}: "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
                print(f"FAILED {failures[-1]}", flush=True)
            counts["runs"] += 1
            run += 1
            print(f"{counts['kills']} kills, {run} runs, {time.monotonic() - started:.0f} s",
                  flush=True)
        attempts.close()
    finally:
        processes.kill()
    for key, value in sorted(counts.items()):
        print(f"{key}: {value}")
    print(f"failures: {len(failures)}", *failures, sep="\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

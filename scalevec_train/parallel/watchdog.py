"""The hang watchdog: a thread on every rank that tells a stuck run from a slow one and ends it
within minutes, naming the ranks that did not arrive and where, rather than letting every rank wait
in a collective until it times out.

The thread reads this rank's progress (infra/progress.py: the step, its phase and when its span
began) every POLL_S and publishes it in the process group's key-value store (torchrun's TCPStore,
through a client of its own) when it changed and at least every PULSE_S, with a count that every
publication raises: a sign of life that needs no clock shared between hosts. Once armed
(after the first step), a span that lasts longer than bound() is a hang: the rank reads every rank's
publication twice, LIVENESS_S apart. Ranks whose count did not move are not running (stopped,
frozen, their host lost); else the ranks furthest behind in (step, phase) did not arrive; else every
rank waits in one place (a rank stuck there, or a collective that does not complete: the stacks
tell). It flags the hang in the store, writes its Python stacks (every thread; on NCCL also the
flight recorder's collectives) to run_dir/hang/, prints one line (HungError) and ends the process
with exit code 5; every rank that sees the flag does the same, as does one whose collective that
exit broke (follow()).
The main thread is stuck: only another thread can.

SIGTERM reaches the thread through the signal module's wakeup file even while the main thread waits
in a collective (Python runs a handler only once that thread is back in the interpreter). From then
on a span of a kind measured before ends after distributed.sigterm_grace_s or SIGTERM_FACTOR times
the slowest (the larger): a healthy step goes on to the clean stop at the next log step
(training/callbacks/stability.py), a stuck one ends within seconds.
"""

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

import torch

from scalevec_train.infra import faults
from scalevec_train.infra.errors import HungError
from scalevec_train.infra.progress import ORDER, PHASES, Progress
from scalevec_train.parallel.process_group import broadcast_object, rank, store_client, world_size

FACTOR = 5  # a span longer than this many times the slowest recent one is not merely slow
POLL_S = 0.05
PULSE_S = 1.0
LIVENESS_S = 2.5  # how long the counts are watched before a rank is said not to run
SIGTERM_FACTOR = 3
STORE_TIMEOUT = timedelta(seconds=5)


class Watchdog:
    """Watches `progress` on this rank; `floor_s` is distributed.hang_s, `grace_s` its
    sigterm_grace_s. Every rank makes one (a collective: the ranks agree on where in the store they
    meet), in the main thread."""

    def __init__(self, progress: Progress, floor_s: float, run_dir: Path, grace_s: float):
        self.progress, self.floor_s, self.grace_s, self.hang_dir = (progress, floor_s, grace_s,
                                                                    run_dir / "hang")
        self.rank, self.world = rank(), world_size()
        self.store = store_client()
        if self.store is not None:
            self.store.set_timeout(STORE_TIMEOUT)
        self.prefix = f"scalevec/watchdog/{broadcast_object(uuid.uuid4().hex)}/"
        self.armed = False  # set by the caller once the first step has finished
        self.sigterm_at: float | None = None
        self._stopped = threading.Event()
        # the store client: the thread's, and a fault's stop in the main thread
        self._lock = threading.Lock()
        self._count, self._published = 0, None
        # (read end, write end, the previous wakeup fd)
        self._wakeup: tuple[int, int, int] | None = None
        self._thread = threading.Thread(target=self._run, name="scalevec-hang-watchdog",
                                        daemon=True)

    def start(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread():  # only it may set the wakeup fd
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wakeup = read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if self.store is not None:
            faults.on_stop(self.publish)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        faults.on_stop(None)
        if self._wakeup is not None:
            read, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)

    def follow(self, error: BaseException) -> None:
        """The main thread fails with `error`. Where another rank found a hang, that rank's exit is
        what broke the collective this rank waited in: end as it did (exit 5, its line), with
        `error`'s traceback, where this rank waited, beside the stacks, rather than as a bug
        (exit 1)."""
        self._stopped.set()
        self._thread.join()
        flag = self._flag() if self.store is not None else None
        if flag is not None:
            self._end(flag, f"{flag} (rank {self.rank} followed the rank that found the hang)",
                      error)

    def bound(self, phase: str) -> tuple[float, str]:
        """How long a span may last in `phase` before it is a hang, and why. A kind's first span (a
        first evaluation or save: its length unknown) is not judged; the collectives' timeout bounds
        it."""
        kind = PHASES[phase][1]
        if not self.progress.recent.get(kind):
            return float("inf"), ""
        scale = max(self.progress.slowest("step"), self.progress.slowest(kind))
        slowest = (f"the slowest recent step{'' if kind == 'step' else ' or ' + kind} "
                   f"({scale:.2f} s)")
        bound = max(self.floor_s, FACTOR * scale)
        why = f"the larger of distributed.hang_s={self.floor_s:g} and {FACTOR}x {slowest}"
        if self.sigterm_at is not None:
            after = max(self.grace_s, SIGTERM_FACTOR * scale)
            if after < bound:
                bound = after
                why = (f"after a SIGTERM, the larger of distributed.sigterm_grace_s="
                       f"{self.grace_s:g} and {SIGTERM_FACTOR}x {slowest}")
        return bound, why

    def publish(self) -> None:
        """Put this rank's progress and a new sign of life in the store."""
        step, phase, since = where = self.progress.where
        self._count += 1
        value = json.dumps({"step": step, "phase": phase, "elapsed": time.monotonic() - since,
                            "count": self._count})
        try:
            with self._lock:
                self.store.set(f"{self.prefix}{self.rank}", value)
        except Exception:  # a store that does not answer: the ranks' own bounds still hold
            pass
        self._published = where

    def _run(self) -> None:
        next_pulse = 0.0
        while not self._stopped.wait(POLL_S):
            now = time.monotonic()
            self._read_signals(now)
            where = self.progress.where
            if self.store is not None and (where != self._published or now >= next_pulse):
                self.publish()
                if now >= next_pulse:
                    next_pulse = now + PULSE_S
                    flag = self._flag()
                    if flag is not None:
                        self._end(flag, f"{flag} (rank {self.rank} followed the rank that found "
                                  "the hang)")
            if self.armed and now - where[2] > self.bound(where[1])[0]:
                self._hang(where)

    def _read_signals(self, now: float) -> None:
        if self._wakeup is None:
            return
        try:
            got = os.read(self._wakeup[0], 512)
        except BlockingIOError:
            return
        if signal.SIGTERM in got and self.sigterm_at is None:
            self.sigterm_at = now

    def _hang(self, where: tuple[int, str, float]) -> None:
        step, phase, since = where
        (bound, why), sigterm = self.bound(phase), self.sigterm_at is not None
        first = self._read_all() if self.store is not None else None
        deadline = time.monotonic() + LIVENESS_S
        while time.monotonic() < deadline:  # this rank's own signs of life go on meanwhile
            if self._stopped.wait(PULSE_S / 4) or self.progress.where != where:
                return  # the run ended, or moved on: slow, not stuck
            if self.store is not None:
                self.publish()
        flag = self._flag() if self.store is not None else None
        if flag is not None:
            self._end(flag, f"{flag} (rank {self.rank} followed the rank that found the hang)")
        elapsed = time.monotonic() - since
        ranks = (f" {culprits(first, self._read_all(), self.rank)}." if self.store is not None
                 else "")
        problem = (f"{'SIGTERM while hung: ' if sigterm else ''}no progress on rank {self.rank} "
                   f"for {elapsed:.0f} s in {phase} of step {step}, over its bound of "
                   f"{bound:.0f} s: {why}.{ranks} The Python stacks of every rank still running "
                   f"are in {self.hang_dir}/rank<r>.txt.")
        fix = (("continue with resume=auto: the steps since the newest complete checkpoint are "
                "lost.") if sigterm else
               "look at the named ranks' stacks and hosts, then continue with resume=auto (from "
               "the newest complete checkpoint); if the run is slow rather than stuck, raise "
               "distributed.hang_s.")
        message = str(HungError(f"training (step {step})", problem, fix))
        if self.store is not None:
            try:
                with self._lock:
                    self.store.set(f"{self.prefix}hang", message)
            except Exception:
                pass
        self._end(message, message)

    def _flag(self) -> str | None:
        """The hang another rank found, if any."""
        try:
            with self._lock:
                if self.store.check([f"{self.prefix}hang"]):
                    return self.store.get(f"{self.prefix}hang").decode()
        except Exception:
            pass
        return None

    def _read_all(self) -> dict[int, dict] | None:
        """Every rank's latest publication (None where there is none); None if the store does not
        answer."""
        keys = [f"{self.prefix}{r}" for r in range(self.world)]
        try:
            with self._lock:
                if self.store.check(keys):
                    return {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
                return {r: json.loads(self.store.get(k)) if self.store.check([k]) else None
                        for r, k in enumerate(keys)}
        except Exception:
            return None

    def _end(self, message: str, header: str, error: BaseException | None = None) -> None:
        """Dump this rank's stacks (and `error`'s traceback: by default the one the main thread is
        handling, whose frames show where it waited once its collective broke), say `message` on one
        line and end the process."""
        if error is None:
            error = _handled(threading.main_thread())
        try:
            self.hang_dir.mkdir(parents=True, exist_ok=True)
            with (self.hang_dir / f"rank{self.rank}.txt").open("w") as f:
                f.write(f"{header}\n\n")
                if error is not None:
                    f.write("".join(traceback.format_exception(error)) + "\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        finally:
            prefix = f"[rank {self.rank}] " if self.world > 1 else ""
            sys.stdout.flush()
            sys.stderr.write(f"{prefix}error: {message}\n")
            sys.stderr.flush()
            try:  # last: a dump that blocks can only delay the exit
                _dump_flight_recorder(self.hang_dir / f"nccl_trace_rank_{self.rank}")
            finally:
                os._exit(HungError.exit_code)


def _handled(thread: threading.Thread) -> BaseException | None:
    """The exception `thread` is handling (in an except or finally clause), if any."""
    current = sys._current_exceptions().get(thread.ident)
    return current[1] if isinstance(current, tuple) else current  # a 3-tuple before Python 3.12


def culprits(first: dict[int, dict] | None, second: dict[int, dict] | None, me: int) -> str:
    """Who did not arrive, from every rank's publications read twice (`first`, `second`; None where
    the store did not answer): the ranks that published nothing new in between, else those furthest
    behind, else every rank in one place. `me`: the rank that reads them (running, whatever it
    published)."""
    if first is None or second is None:
        return "The other ranks are unknown: the process group's store did not answer"
    silent = [r for r in second if r != me and (second[r] is None or second[r] == first[r])]
    live = {r: p for r, p in second.items() if r not in silent and p is not None}
    if silent:
        seen = {r: second[r] for r in silent if second[r] is not None}
        places = {(p["step"], p["phase"]) for p in seen.values()}
        if len(places) == 1 and len(seen) == len(silent):
            (step, phase), = places
            last = f"last seen in {phase} of step {step}"
        else:
            last = f"last seen: {_places(seen, durations=False)}" if seen else "never seen"
        one = len(silent) == 1
        return (f"{_ranks(silent).capitalize()} {'shows' if one else 'show'} no sign of life "
                f"(stopped, frozen, or {'its' if one else 'their'} host lost; {last})"
                f"{'; running: ' + _places(live) if live else ''}")
    behind = min((p["step"], ORDER[p["phase"]]) for p in live.values())
    late = {r: p for r, p in live.items() if (p["step"], ORDER[p["phase"]]) == behind}
    if len(late) == len(live):
        step, phase = next(iter(live.values()))["step"], next(iter(live.values()))["phase"]
        return (f"Every rank is in {phase} of step {step} "
                f"({min(p['elapsed'] for p in live.values()):.0f} s): one is stuck there, or a "
                "collective does not complete (the stacks show which)")
    return (f"{_ranks(list(late)).capitalize()} did not arrive: {_places(late)}, while the "
            f"others wait: {_places({r: p for r, p in live.items() if r not in late})}")


def _places(published: dict[int, dict], durations: bool = True) -> str:
    """'ranks 0, 2 in optimizer of step 3 (12 s); rank 1 in data of step 3 (12 s)': the ranks by
    place, with how long the latest of them had been there."""
    groups: dict[tuple[int, str], list[int]] = {}
    for r, p in sorted(published.items()):
        groups.setdefault((p["step"], p["phase"]), []).append(r)
    return "; ".join(
        f"{_ranks(rs)} in {phase} of step {step}"
        + (f" ({min(published[r]['elapsed'] for r in rs):.0f} s)" if durations else "")
        for (step, phase), rs in sorted(groups.items(), key=lambda g: (g[0][0], ORDER[g[0][1]])))


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-2, 5'."""
    ranks, runs = sorted(ranks), []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _dump_flight_recorder(path: Path) -> None:
    """On NCCL, the collectives its flight recorder holds (TORCH_NCCL_TRACE_BUFFER_SIZE), in the
    file torch's flight-recorder analyser reads: NCCL dumps them itself only at its own timeout,
    which the watchdog comes before. Given up after 10 s."""
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if dump is None or not torch.cuda.is_available():
        return
    writer = threading.Thread(target=lambda: path.write_bytes(dump()), daemon=True)
    writer.start()
    writer.join(10)

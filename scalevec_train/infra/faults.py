"""Fault injection at named points of a training step, of a checkpoint save and of a data
preparation, for the tests of what a kill, a hang, a failed write or a non-finite step leaves behind
(docs/guides/reliability.md). Unset in real runs, where a point costs one environment lookup.
Imports no torch until a checkpoint is written: data preparation (and its worker processes) runs
without it.

SCALEVEC_FAULT_AT=<point>:<step>[@<rank>][=<action>], comma-separated entries: when rank `rank`
(every rank without @) reaches `point` (POINTS) of step `step` (for the save points: of the
checkpoint of that step; for the preparation points: of that part, 0 where there is none; the rank
of a preparation is its process's among those preparing together), `action` (ACTIONS; stop where
none is given) happens there. The first entry that matches a point, step and rank applies.
"""

import errno
import io
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from scalevec_train.infra.errors import ScalevecError

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint import FileSystemWriter

FAULT_AT_ENV = "SCALEVEC_FAULT_AT"
SLEEP_S = 1.0
POINTS = {
    "step.start": "before the step draws its batches",
    "step.loss": "each micro-batch's training loss computed, before its backward",
    "step.optimizer": "the gradients synced, before the optimizer steps",
    "step.record": "the optimizer stepped, before the step's record is written",
    "step.checkpoint": "the record written, before the step's checkpoint (if it saves one)",
    "data.batch": "the loader, before it reads a micro-batch (the step: the one in progress, "
                  "infra/progress.py)",
    "save.folder": "rank 0, before it makes the checkpoint's temporary folder",
    "save.files": "halfway through the first write of this rank's shard file (an async save: in "
                  "its thread)",
    "save.agree": "this rank's files written, before the ranks compare their outcomes",
    "save.state": "rank 0, before it writes train_state.json",
    "save.marker": "rank 0, train_state.json written, before it writes checksums.json and COMPLETE",
    "save.rename": "rank 0, COMPLETE written, before it renames the folder into place",
    "save.retain": "rank 0, the checkpoint in place, before older ones are moved out of sight",
    "save.delete": "rank 0, older checkpoints moved out of sight, before they are deleted",
    "prepare.tokenizer": "the cache's lock taken, before the tokenizer is trained and written",
    "prepare.shards": "a part's first shard file written, the part unfinished (its folder still "
                      "temporary)",
    "prepare.part": "a part's shards and record written, before its folder is renamed into place",
    "prepare.count": "this process's parts written, before it records how many parts there are",
    "prepare.links": "the merge: every shard linked into the prepared folder, before its manifests",
    "prepare.rename": "the merge: the manifests written, before the prepared folder is renamed "
                      "into place",
    "prepare.cleanup": "the prepared folder in place, before the parts are removed",
}
ACTIONS = {
    "stop": "the process stops itself (SIGSTOP): a test can SIGKILL it, or every rank, at exactly "
            "that moment",
    "hang": "the main thread blocks there for good, the process alive (a stuck read, a deadlocked "
            "data worker)",
    "sleep": f"the process sleeps {SLEEP_S:g} s there, then goes on (a slow rank)",
    "nospace": "the write there fails as on a full disk (OSError ENOSPC)",
    "ioerror": "the write there fails as on a failing disk (OSError EIO)",
    "nan": "step.loss only: the loss is made NaN, so the step is not finite",
    "infgrad": "step.loss only: the loss stays finite, its backward starts from an "
               "infinite gradient",
}
LOSS_ACTIONS = ("nan", "infgrad")
ERRNOS = {"nospace": errno.ENOSPC, "ioerror": errno.EIO}
_before_stop: list[Callable[[], None]] = []  # on_stop()


def fault_point(point: str, step: int, rank: int | None = None) -> None:
    """Apply the fault that the environment places at `point` of `step` on this rank (torch's,
    unless `rank` is given), if any."""
    _apply(_action(point, step, rank), point, step)


def loss_fault(loss: "torch.Tensor", step: int) -> "torch.Tensor":
    """A micro-batch's training loss `loss` of `step`, with the fault the environment places
    at step.loss of that step on this rank, if any."""
    action = _action("step.loss", step)
    if action == "nan":
        return loss * float("nan")
    if action == "infgrad":
        loss.register_hook(lambda grad: grad * float("inf"))
        return loss
    _apply(action, "step.loss", step)
    return loss


def on_stop(hook: Callable[[], None] | None) -> None:
    """Call `hook` (None: nothing) just before this process stops itself at a fault: the hang
    watchdog publishes there where its rank is, as it would have for a rank stuck there for longer
    than the moment between its phase's mark and a stop."""
    _before_stop[:] = [] if hook is None else [hook]


def check_faults() -> None:
    """Raise, naming the entry, where the environment's fault entries are malformed: a run checks
    them before its expensive work rather than at the first point it reaches."""
    _entries()


def checkpoint_writer(path: Path, step: int) -> "FileSystemWriter":
    """DCP's file writer into `path`, the folder of the checkpoint of `step`; where the environment
    puts a fault at save.files of that step, its shard files meet it halfway through their first
    write."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(path)
    if _action("save.files", step) is not None:
        writer.fs.create_stream = _interrupted(writer.fs.create_stream,
                                               lambda: fault_point("save.files", step))
    return writer


def _action(point: str, step: int, rank: int | None = None) -> str | None:
    for name, at_step, only, action in _entries():
        if ((name, at_step) == (point, step)
                and (only is None or only == (_rank() if rank is None else rank))):
            return action
    return None


def _entries() -> list[tuple[str, int, int | None, str]]:
    """The environment's entries: (point, step, rank or None for every rank, action)."""
    raw = os.environ.get(FAULT_AT_ENV)
    if not raw:
        return []
    entries = []
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        where, _, action = entry.partition("=")
        name, _, at = where.partition(":")
        at_step, _, only = at.partition("@")
        action = action or "stop"
        if (name not in POINTS or action not in ACTIONS
                or (action in LOSS_ACTIONS and name != "step.loss")
                or not at_step.isdigit() or not (only == "" or only.isdigit())):
            raise ScalevecError(FAULT_AT_ENV, f"{entry!r} is not "
                                "<point>:<step>[@<rank>][=<action>] with a point of "
                                f"{', '.join(POINTS)} and an action of {', '.join(ACTIONS)} "
                                f"({' and '.join(LOSS_ACTIONS)} at step.loss only).",
                                "unset it (it only injects faults for tests), or write e.g. "
                                "save.marker:6@0=stop or step.loss:3=nan.")
        entries.append((name, int(at_step), int(only) if only else None, action))
    return entries


def _apply(action: str | None, point: str, step: int) -> None:
    if action == "stop":
        for hook in _before_stop:
            hook()
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "hang":
        threading.Event().wait()
    elif action == "sleep":
        time.sleep(SLEEP_S)
    elif action is not None:
        code = ERRNOS[action]
        raise OSError(code, f"{os.strerror(code)} (injected by {FAULT_AT_ENV} at {point}:{step})")


def _rank() -> int:
    """torch's rank, not parallel.process_group's: this module sits below parallel/ in the
    layers."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _interrupted(create_stream: Callable, fault: Callable[[], None]) -> Callable:
    """DCP's file system's create_stream, with a fault halfway through the first write of each shard
    file."""

    @contextmanager
    def create(path, mode: str) -> Iterator[io.IOBase]:
        with create_stream(path, mode) as stream:
            yield _HalfWay(stream, fault) if Path(path).suffix == ".distcp" else stream

    return create


class _HalfWay(io.IOBase):
    """A file whose first write stops halfway, flushed (what a kill or a full disk then leaves), for
    the fault; the rest of the writes go through."""

    def __init__(self, stream: io.IOBase, fault: Callable[[], None]):
        self.stream, self.pending = stream, fault

    def write(self, data) -> int:
        if self.pending is None:
            return self.stream.write(data)
        view = memoryview(data).cast("B")
        half = len(view) // 2
        self.stream.write(view[:half])
        self.stream.flush()
        fault, self.pending = self.pending, None
        fault()
        return half + self.stream.write(view[half:])

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

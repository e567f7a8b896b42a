"""Where this process is in its run: the step and its phase (PHASES), marked by the trainer, the
data loaders, the evaluations and the checkpoint manager, and how long the latest spans of each kind
took. A mark is a clock read and an attribute write (no I/O, no read of the device): the hang
watchdog (parallel/watchdog.py) reads them from its own thread.

A span is the time from a mark that begins one to the next: a step (data, then forward/backward,
optimizer and record, unless an evaluation or a checkpoint comes between), an evaluation or a
checkpoint; marking data begins a new step, and a mark of another kind than the current span's
begins a span of that kind.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager

# phase: (what the process does in it, the kind of span it belongs to)
PHASES = {
    "start-up": ("joining the group, preparing the data, building or loading the run, the "
                 "first step", "start-up"),
    "data": ("drawing the step's batches", "step"),
    "forward/backward": ("the micro-batches' forward and backward, with their gathers and "
                         "reductions", "step"),
    "optimizer": ("clipping, the loss's mean over the ranks and the optimizer step", "step"),
    "record": ("the step's callbacks, read-back and metrics record", "step"),
    "evaluation": ("validation or downstream tasks", "evaluation"),
    "checkpoint": ("a checkpoint written, or an asynchronous one completed", "checkpoint"),
}
# the order of a step's phases, to tell who is behind
ORDER = {phase: i for i, phase in enumerate(PHASES)}
RECENT = 20  # spans of each kind whose durations are kept


class Progress:
    """This process's place: `where` is (step, phase, the monotonic time its span began), replaced
    whole (one attribute write, so that another thread reads it consistent); `recent` maps a kind to
    the durations of its latest RECENT spans."""

    def __init__(self):
        self.reset(0)

    def reset(self, step: int) -> None:
        """A run starts (at `step`): in start-up, nothing measured."""
        self.where = (step, "start-up", time.monotonic())
        self.recent: dict[str, tuple[float, ...]] = {}

    def mark(self, phase: str, step: int) -> None:
        now = time.monotonic()
        _, current, since = self.where
        kind = PHASES[current][1]
        if phase == "data" or PHASES[phase][1] != kind:
            self.recent[kind] = (*self.recent.get(kind, ())[1 - RECENT:], now - since)
            since = now
        self.where = (step, phase, since)

    @contextmanager
    def phase(self, phase: str, step: int) -> Iterator[None]:
        """In `phase` of `step` within the context; then back in the phase it was in
        (a span anew)."""
        before_step, before, _ = self.where
        self.mark(phase, step)
        try:
            yield
        finally:
            self.mark(before, before_step)

    def slowest(self, kind: str) -> float:
        """The longest of the latest spans of `kind` (0 when none has ended)."""
        return max(self.recent.get(kind, ()), default=0.0)


current = Progress()  # this process's: one run trains at a time

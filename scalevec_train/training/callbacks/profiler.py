"""Traces on demand: a PyTorch profiler trace of chosen steps (Chrome format) and, on CUDA, a memory
snapshot of them (docs/guides/experiments.md, "Traces of chosen steps")."""

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from scalevec_train.training.trainer import Callback, StepResult, Trainer

# allocation events the CUDA memory history keeps (torch's default): a step's worth at the sizes
# here
MEMORY_ENTRIES = 100_000


class StepProfiler(Callback):
    """Profiles each step in `steps` on its own: from before its first forward to after its
    optimizer step, as `ProfilerStep#<step>`, written to `out/step_<step>.rank<r>.json` (a Chrome
    trace, which names the fused ops by their torch.library names, scalevec::rms_norm_fwd and the
    like); on CUDA also the allocations of the step as `out/step_<step>.rank<r>.memory.pickle`.
    Other steps are untouched."""

    # first: the trace holds the training step, not the evaluations or checkpoints of other hooks
    priority = -1

    def __init__(self, steps: list[int], out: Path, rank: int, record_shapes: bool = False):
        self.steps, self.out, self.rank, self.record_shapes = (set(steps), Path(out), rank,
                                                               record_shapes)
        self._profile: profile | None = None
        self._marker: record_function | None = None

    def on_step_start(self, trainer: Trainer) -> None:
        step = trainer.step + 1
        if step not in self.steps:
            return
        cuda = trainer.compute.device.type == "cuda"
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self._profile = profile(activities=activities, record_shapes=self.record_shapes)
        self._profile.start()
        self._marker = record_function(f"ProfilerStep#{step}")
        self._marker.__enter__()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._profile is None:
            return
        if trainer.compute.device.type == "cuda":
            torch.cuda.synchronize(trainer.compute.device)  # the step's kernels belong in its trace
        traced = self._stop()
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"step_{trainer.step:06d}.rank{self.rank}"
        traced.export_chrome_trace(f"{stem}.json")
        if trainer.compute.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(f"{stem}.memory.pickle")
            torch.cuda.memory._record_memory_history(enabled=None)

    def on_close(self, trainer: Trainer) -> None:
        if self._profile is not None:  # a step that raised: stop recording, write nothing
            self._stop()
            if trainer.compute.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)

    def _stop(self) -> profile:
        traced = self._profile
        self._marker.__exit__(None, None, None)
        traced.stop()
        self._profile = self._marker = None
        return traced

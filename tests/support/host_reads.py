"""Counting the host's reads of tensor values during training: `torchrun ...
tests/support/host_reads.py runs.json` trains each run of runs.json (a list of [out, overrides]) one
after the other in the one process group, as tests/support/train_many.py does, with a counter around
every step that does not log, and writes the counts of this rank to out (a path per rank: {rank} is
replaced). count_reads() does one run in this process.

A read is any aten._local_scalar_dense (item(), float(), int(), bool() of a tensor) and any tolist()
(which on the CPU reads memory without an aten call). Reads of the optimizer's step counters are
counted apart: torch's for-loop AdamW keeps them on the host on every device, so reading them never
waits for a device; every other read would. The counts also say how many tensors the trainer's
ConditionalStep keeps copies of (none for optimizers that skip a step themselves).
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scalevec_train import train
from scalevec_train.config import compose_config
from scalevec_train.parallel import process_group
from scalevec_train.training.trainer import Callback, Trainer


class ReadCounter(TorchDispatchMode):
    """Counts reads while active (start() to stop())."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.optimizer = optimizer
        self.active = False
        self.reads = self.step_counter_reads = 0

    def start(self) -> None:
        self.active = True
        self.__enter__()

    def stop(self) -> None:
        if self.active:
            self.__exit__(None, None, None)
            self.active = False

    def count(self, t: torch.Tensor) -> None:
        counters = {s["step"].data_ptr() for s in self.optimizer.state.values()
                    if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"}
        if t.data_ptr() in counters:
            self.step_counter_reads += 1
        else:
            self.reads += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count(args[0])
        return func(*args, **(kwargs or {}))


class CountNonLogSteps(Callback):
    """Counts from the start of every step that does not log (as the trainer decides it when the
    step starts) to the end of its last hook: one instance runs before every other callback, one
    (`closing`) after every other."""

    def __init__(self, counter: ReadCounter, closing: bool):
        self.counter, self.closing = counter, closing
        self.priority = 2 if closing else -2  # the callbacks' priorities are -1 (the profiler) to 1
        self.steps = 0

    def on_step_start(self, trainer: Trainer) -> None:
        if not self.closing and not trainer.is_log_step(trainer.step + 1):
            self.steps += 1
            self.counter.start()

    def on_step_done(self, trainer: Trainer) -> None:
        if self.closing:
            self.counter.stop()


def count_reads(overrides: list[str], out: Path) -> None:
    build, original_tolist = train.build, torch.Tensor.tolist
    made: list[tuple[ReadCounter, CountNonLogSteps, Trainer]] = []

    def counted(cfg):
        built = build(cfg)
        counter = ReadCounter(built.trainer.optimizer)
        opening = CountNonLogSteps(counter, closing=False)
        built.trainer.add_callbacks(opening, CountNonLogSteps(counter, closing=True))
        made.append((counter, opening, built.trainer))
        return built

    def tolist(t):
        if made and made[-1][0].active:
            made[-1][0].count(t)
        return original_tolist(t)

    train.build, torch.Tensor.tolist = counted, tolist
    try:
        train.run(compose_config(overrides, process_group.world_size()))
    finally:
        train.build, torch.Tensor.tolist = build, original_tolist
    counter, opening, trainer = made[-1]
    Path(str(out).format(rank=process_group.rank())).write_text(json.dumps(
        {"steps": opening.steps, "reads": counter.reads,
         "step_counter_reads": counter.step_counter_reads,
         "copies": len(trainer.optimizer_step.copies)}))


if __name__ == "__main__":
    process_group.init()
    finished = False
    try:
        for out, overrides in json.loads(Path(sys.argv[1]).read_text()):
            count_reads(overrides, Path(out))
        finished = True
    finally:
        process_group.shutdown(finished)

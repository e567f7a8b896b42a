"""Saving checkpoints during a run: periodically, at the last step, and at the step of an early
stop."""

from pathlib import Path

from scalevec_train.checkpoint.manager import CheckpointManager
from scalevec_train.training.trainer import Callback, Trainer


class Checkpointer(Callback):
    """Saves every `every` steps (0: never in between), at the end and when the run stops early; the
    last save is complete once the fit ends. `last_path` is the newest checkpoint written. A step
    that saves reads back (the callbacks' state is current); a stop comes only at such a step."""

    def __init__(self, manager: CheckpointManager, every: int):
        self.manager, self.every = manager, every
        self.last_path: Path | None = None

    def _periodic(self, trainer: Trainer, step: int) -> bool:
        return step == trainer.schedule.steps or bool(self.every and step % self.every == 0)

    def on_step_start(self, trainer: Trainer) -> None:
        if self._periodic(trainer, trainer.step + 1):
            trainer.request_read_back()

    def on_step_done(self, trainer: Trainer) -> None:
        if self._periodic(trainer, trainer.step) or trainer.stop_reason:
            self.last_path = self.manager.save(trainer.step)

    def on_fit_end(self, trainer: Trainer) -> None:
        self.manager.finish()

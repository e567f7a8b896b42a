"""Downstream tasks in the loop: multiple-choice accuracy and bits per byte (scalevec_train/tasks)."""

from scalevec_train.tasks.scoring import EncodedTask, score
from scalevec_train.training.trainer import Callback, StepResult, Trainer


class TaskEvaluator(Callback):
    """task/<name>/{acc,acc_norm,bpb,chance} of every task at step 0 of a fresh run, every `every` steps
    (0: never in between) and at the last step, as the Evaluator's val_loss. `rank` of `world` scores its
    share of the items (tasks/scoring.py); the model runs in eval mode and draws no random numbers, so
    training goes on exactly as without it."""

    def __init__(self, tasks: list[EncodedTask], every: int, batch_size: int, rank: int, world: int):
        self.tasks, self.every, self.batch_size, self.rank, self.world = tasks, every, batch_size, rank, world

    def _record(self, trainer: Trainer) -> None:
        for task in self.tasks:
            for metric, value in score(trainer.model, task, trainer.device, trainer.autocast, self.batch_size,
                                       self.rank, self.world).items():
                trainer.record(f"task/{task.name}/{metric}", value)

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.step == 0:
            self._record(trainer)

    def _scores(self, trainer: Trainer, step: int) -> bool:
        return step == trainer.steps or bool(self.every and step % self.every == 0)

    def on_step_start(self, trainer: Trainer) -> None:
        if self._scores(trainer, trainer.step + 1):
            trainer.request_read_back()  # it writes a record: what the guard has to write comes first

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._scores(trainer, trainer.step):
            self._record(trainer)

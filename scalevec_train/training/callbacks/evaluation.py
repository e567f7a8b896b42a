"""Validation: the loss on the same held-out batches every time, so that runs of any seed and world
size compare."""

import torch

from scalevec_train.parallel.process_group import all_reduce_mean
from scalevec_train.training.trainer import Callback, StepResult, Trainer, cross_entropy


class Evaluator(Callback):
    """val_loss at step 0 of a fresh run, every `every` steps (0: never in between) and at the last
    step. `batches`: this rank's share of the validation batches, (inputs, targets) each."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], every: int):
        self.batches, self.every = batches, every

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> torch.Tensor:
        """The validation loss, on the device."""
        model = trainer.model
        model.eval()
        total = torch.zeros((), device=trainer.device)
        for inputs, targets in self.batches:
            with trainer.autocast():
                total += cross_entropy(model(inputs.to(trainer.device)), targets.to(trainer.device))
        model.train()
        return all_reduce_mean(total / len(self.batches))

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.step == 0:
            trainer.record("val_loss", self.evaluate(trainer))

    def _evaluates(self, trainer: Trainer, step: int) -> bool:
        return step == trainer.steps or bool(self.every and step % self.every == 0)

    def on_step_start(self, trainer: Trainer) -> None:
        if self._evaluates(trainer, trainer.step + 1):
            trainer.request_read_back()  # it writes a record: what the guard has to write comes first

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._evaluates(trainer, trainer.step):
            trainer.record("val_loss", self.evaluate(trainer))

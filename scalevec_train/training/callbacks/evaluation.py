"""Validation: the loss on the same held-out batches every time, so that runs of any seed and world
size compare."""

import torch

from scalevec_train.data.loader import Batch
from scalevec_train.parallel.process_group import all_reduce_mean
from scalevec_train.training.trainer import Callback, StepResult, Trainer, cross_entropy, micro_weights


class Evaluator(Callback):
    """val_loss at step 0 of a fresh run, every `every` steps (0: never in between) and at the last
    step. `batches`: this rank's share of the validation batches. With document ids, the loss is the
    mean over the counted targets of all batches and ranks (as the training loss)."""

    def __init__(self, batches: list[Batch], every: int):
        self.batches, self.every = batches, every

    def evaluate(self, trainer: Trainer) -> torch.Tensor:
        """The validation loss, on the device."""
        return validation_loss(trainer.model, self.batches, trainer.device, trainer.autocast)

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


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[Batch], device: torch.device, autocast) -> torch.Tensor:
    """The mean loss of `model` over this rank's validation `batches` and all ranks, on the device (also
    how an averaged checkpoint is evaluated: scalevec_train/evaluate.py)."""
    model.eval()
    total = torch.zeros((), device=device)
    documents = batches[0].doc_ids is not None
    weights = micro_weights(batches, device) if documents else None
    for i, (inputs, targets, doc_ids) in enumerate(batches):
        with autocast():
            if doc_ids is None:
                total += cross_entropy(model(inputs.to(device)), targets.to(device))
            else:
                total += cross_entropy(model(inputs.to(device), doc_ids=doc_ids.to(device)),
                                       targets.to(device)) * weights[i]
    model.train()
    return all_reduce_mean(total / len(batches) if weights is None else total)

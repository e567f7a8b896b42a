"""Validation: the loss on the same held-out batches every time, so that runs of any seed and world
size compare; and the same loss in bits per byte of the text, so that runs of any tokenizer compare."""

import math

import numpy as np
import torch

from scalevec_train.data.loader import IGNORE, Batch
from scalevec_train.parallel.process_group import all_reduce_mean, all_reduce_sum
from scalevec_train.training.trainer import Callback, StepResult, Trainer, cross_entropy, micro_weights


class Evaluator(Callback):
    """val_loss (and val_bpb) at step 0 of a fresh run, every `every` steps (0: never in between) and at
    the last step. `batches`: this rank's share of the validation batches. With document ids, the loss is the
    mean over the counted targets of all batches and ranks (as the training loss).

    With `token_bytes` (data.tokenizer.token_bytes: the UTF-8 bytes of text each id stands for) it also
    records val_bpb = (sum of the counted targets' NLL in nats) / ln 2 / (bytes those targets stand for),
    over all batches and ranks. The bytes are counted once here on the host; the NLL sums ride along on
    the device, so evaluating reads nothing more."""

    def __init__(self, batches: list[Batch], every: int, token_bytes: np.ndarray | None = None):
        self.batches, self.every = batches, every
        self.counts = counted_targets(batches)
        self.bytes = None if token_bytes is None else sum(
            int(token_bytes[b.targets[b.targets != IGNORE].numpy()].sum()) for b in batches)

    def evaluate(self, trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The validation loss and bits per byte (None without token_bytes), on the device."""
        val_loss, nll = validation_loss(trainer.model, self.batches, trainer.device, trainer.autocast, self.counts)
        if self.bytes is None:
            return val_loss, None
        sums = all_reduce_sum(torch.stack([nll, torch.tensor(float(self.bytes), dtype=torch.float64,
                                                             device=trainer.device)]))
        return val_loss, (sums[0] / sums[1] / math.log(2)).float()

    def _record(self, trainer: Trainer) -> None:
        val_loss, val_bpb = self.evaluate(trainer)
        trainer.record("val_loss", val_loss)
        if val_bpb is not None:
            trainer.record("val_bpb", val_bpb)

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.step == 0:
            self._record(trainer)

    def evaluates(self, trainer: Trainer, step: int) -> bool:
        """Whether step `step` is validated (every `every` steps and the last)."""
        return step == trainer.steps or bool(self.every and step % self.every == 0)

    def on_step_start(self, trainer: Trainer) -> None:
        if self.evaluates(trainer, trainer.step + 1):
            trainer.request_read_back()  # it writes a record: what the guard has to write comes first

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.evaluates(trainer, trainer.step):
            self._record(trainer)



def counted_targets(batches: list[Batch]) -> list[int]:
    """The targets each batch counts in the loss (not IGNORE)."""
    return [int((b.targets != IGNORE).sum()) for b in batches]


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[Batch], device: torch.device, autocast,
                    counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss of `model` over this rank's validation `batches` and all ranks, and this rank's summed
    NLL in nats (fp64; `counts`: the counted targets of each batch), on the device (also how an averaged
    checkpoint is evaluated: scalevec_train/evaluate.py)."""
    model.eval()
    total = torch.zeros((), device=device)
    nll = torch.zeros((), device=device, dtype=torch.float64)
    documents = batches[0].doc_ids is not None
    weights = micro_weights(batches, device) if documents else None
    for i, (inputs, targets, doc_ids) in enumerate(batches):
        with autocast():
            if doc_ids is None:
                loss = cross_entropy(model(inputs.to(device)), targets.to(device))
                total += loss
            else:
                loss = cross_entropy(model(inputs.to(device), doc_ids=doc_ids.to(device)), targets.to(device))
                total += loss * weights[i]
        nll += loss.double() * counts[i]
    model.train()
    return all_reduce_mean(total / len(batches) if weights is None else total), nll

"""Validation: the loss on the same held-out batches every time, so that runs of any seed and world
size compare; and the same loss in bits per byte of the text, so that runs of any tokenizer
compare."""

import math

import numpy as np
import torch

from scalevec_train.data.loader import IGNORE, Batch
from scalevec_train.infra import progress
from scalevec_train.parallel.process_group import all_reduce_mean, all_reduce_sum
from scalevec_train.parallel.wrap import eager_blocks
from scalevec_train.tasks.scoring import EncodedTask, score
from scalevec_train.training.trainer import (
    Callback,
    StepResult,
    Trainer,
    cross_entropy,
    micro_weights,
)


class Periodic(Callback):
    """A callback that records something (`record`, a subclass's) at step 0 of a fresh run, every
    `every` steps (0: never in between) and at the last step."""

    every: int

    def record(self, trainer: Trainer) -> None:
        raise NotImplementedError

    def due(self, trainer: Trainer, step: int) -> bool:
        """Whether step `step` records."""
        return step == trainer.schedule.steps or bool(self.every and step % self.every == 0)

    def on_fit_start(self, trainer: Trainer) -> None:
        if trainer.step == 0:
            with progress.current.phase("evaluation", 0):
                self.record(trainer)

    def on_step_start(self, trainer: Trainer) -> None:
        if self.due(trainer, trainer.step + 1):
            # it writes a record: what the guard has to write comes first
            trainer.request_read_back()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.due(trainer, trainer.step):
            with progress.current.phase("evaluation", trainer.step):
                self.record(trainer)


class Validation:
    """The validation set and what is measured on it: val_loss (and val_bpb). `batches`: this rank's
    share of the validation batches. With document ids, the loss is the mean over the counted
    targets of all batches and ranks (as the training loss).

    With `token_bytes` (data.tokenizer.token_bytes: the UTF-8 bytes of text each id stands for) it
    also measures val_bpb = (sum of the counted targets' NLL in nats) / ln 2 / (bytes those targets
    stand for), over all batches and ranks. The bytes are counted once here on the host; the NLL
    sums ride along on the device, so evaluating reads nothing more.

    For a mixture, `batches` maps each source's name to its validation batches and `weights` gives
    the sources' weights: each source's val_loss/<name> (and val_bpb/<name>) is measured as above,
    and the mixture's val_loss (val_bpb) is their weighted mean, the expected loss on a sample of
    the mixture."""

    def __init__(self, batches: list[Batch] | dict[str, list[Batch]],
                 token_bytes: np.ndarray | None = None, weights: dict[str, float] | None = None):
        self.sets = batches if isinstance(batches, dict) else {"": batches}
        weights = weights or {"": 1.0}
        if set(weights) != set(self.sets):
            raise ValueError(f"weights {sorted(weights)} do not name the validation sets "
                             f"{sorted(self.sets)}")
        self.weights = {name: w / sum(weights.values()) for name, w in weights.items()}
        self.counts = {name: counted_targets(b) for name, b in self.sets.items()}
        self.bytes = None if token_bytes is None else {name: sum(
            int(token_bytes[b.targets[b.targets != IGNORE].numpy()].sum()) for b in batches)
            for name, batches in self.sets.items()}

    def evaluate(self, model: torch.nn.Module, device: torch.device, autocast
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """Each validation set's loss and bits per byte (None without token_bytes), on the device,
        by the set's name ("" for a single source's)."""
        out = {}
        for name, batches in self.sets.items():
            val_loss, nll = validation_loss(model, batches, device, autocast, self.counts[name])
            if self.bytes is None:
                out[name] = (val_loss, None)
                continue
            sums = all_reduce_sum(torch.stack([nll, torch.tensor(float(self.bytes[name]),
                                                                 dtype=torch.float64,
                                                                 device=device)]))
            out[name] = (val_loss, (sums[0] / sums[1] / math.log(2)).float())
        return out

    def metrics(self, model: torch.nn.Module, device: torch.device, autocast,
                suffix: str = "") -> dict[str, torch.Tensor]:
        """{val_loss<suffix>: ..., val_bpb<suffix>: ...} of `model` as it is, on the device; for a
        mixture each source's val_loss<suffix>/<name> (val_bpb<suffix>/<name>) first. The Evaluator
        records them (the weight EMA with suffix "_ema"); run/checkpoint_eval.py computes them for a
        checkpoint."""
        results = self.evaluate(model, device, autocast)
        out = {}
        if "" in results:
            val_loss, val_bpb = results[""]
        else:
            for name, (loss, bpb) in results.items():
                out[f"val_loss{suffix}/{name}"] = loss
                if bpb is not None:
                    out[f"val_bpb{suffix}/{name}"] = bpb
            val_loss = sum(self.weights[name] * loss for name, (loss, _) in results.items())
            val_bpb = None if self.bytes is None else sum(self.weights[name] * bpb
                                                          for name, (_, bpb) in results.items())
        out[f"val_loss{suffix}"] = val_loss
        if val_bpb is not None:
            out[f"val_bpb{suffix}"] = val_bpb
        return out

    def record(self, trainer: Trainer, suffix: str = "") -> None:
        """Record the metrics of the trainer's model as it is now."""
        for name, value in self.metrics(trainer.model, trainer.compute.device,
                                        trainer.compute.autocast, suffix).items():
            trainer.record(name, value)


class Evaluator(Periodic):
    """The metrics of `validation` (val_loss, val_bpb) at the steps Periodic says."""

    def __init__(self, validation: Validation, every: int):
        self.validation, self.every = validation, every

    def record(self, trainer: Trainer) -> None:
        self.validation.record(trainer)


def counted_targets(batches: list[Batch]) -> list[int]:
    """The targets each batch counts in the loss (not IGNORE)."""
    return [int((b.targets != IGNORE).sum()) for b in batches]


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[Batch], device: torch.device, autocast,
                    counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss of `model` over this rank's validation `batches` and all ranks, and this rank's
    summed NLL in nats (fp64; `counts`: the counted targets of each batch), on the device (also how
    an averaged checkpoint is evaluated: run/checkpoint_eval.py)."""
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
                loss = cross_entropy(model(inputs.to(device), doc_ids=doc_ids.to(device)),
                                     targets.to(device))
                total += loss * weights[i]
        nll += loss.double() * counts[i]
    model.train()
    return all_reduce_mean(total / len(batches) if weights is None else total), nll


class TaskEvaluator(Periodic):
    """task/<name>/{acc,acc_norm,bpb,chance} of every task at the steps Periodic says (like
    val_loss, with an `every` of its own). `rank` of `world` scores its share of the items
    (tasks/scoring.py); the model runs in eval mode and draws no random numbers, so training goes on
    exactly as without it. The blocks run eagerly here (parallel.wrap.eager_blocks): the items'
    lengths vary from batch to batch, and under distributed.compile each new shape would recompile
    the blocks and leave the training step on graphs compiled for dynamic shapes."""

    def __init__(self, tasks: list[EncodedTask], every: int, batch_size: int, rank: int,
                 world: int):
        self.tasks, self.every, self.batch_size, self.rank, self.world = (
            tasks, every, batch_size, rank, world)

    def record(self, trainer: Trainer) -> None:
        with eager_blocks(trainer.model):
            for task in self.tasks:
                for metric, value in score(trainer.model, task, trainer.compute.device,
                                           trainer.compute.autocast, self.batch_size, self.rank,
                                           self.world).items():
                    trainer.record(f"task/{task.name}/{metric}", value)

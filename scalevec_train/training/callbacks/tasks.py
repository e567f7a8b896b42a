"""Downstream tasks in the loop: multiple-choice accuracy and bits per byte (scalevec_train/tasks)."""

from scalevec_train.parallel.wrap import eager_blocks
from scalevec_train.tasks.scoring import EncodedTask, score
from scalevec_train.training.callbacks.evaluation import Periodic
from scalevec_train.training.trainer import Trainer


class TaskEvaluator(Periodic):
    """task/<name>/{acc,acc_norm,bpb,chance} of every task at the steps Periodic says (like val_loss, with
    an `every` of its own). `rank` of `world` scores its share of the items (tasks/scoring.py); the model
    runs in eval mode and draws no random numbers, so training goes on exactly as without it. The blocks
    run eagerly here (parallel.wrap.eager_blocks): the items' lengths vary from batch to batch, and under
    distributed.compile each new shape would recompile the blocks and leave the training step on graphs
    compiled for dynamic shapes."""

    def __init__(self, tasks: list[EncodedTask], every: int, batch_size: int, rank: int, world: int):
        self.tasks, self.every, self.batch_size, self.rank, self.world = tasks, every, batch_size, rank, world

    def record(self, trainer: Trainer) -> None:
        with eager_blocks(trainer.model):
            for task in self.tasks:
                for metric, value in score(trainer.model, task, trainer.compute.device, trainer.compute.autocast,
                                           self.batch_size, self.rank, self.world).items():
                    trainer.record(f"task/{task.name}/{metric}", value)

"""The configured tasks (tasks.items), read or generated and tokenized: what the training loop's
TaskEvaluator and `python -m scalevec_train.evaluate tasks=...` score."""

import logging
from pathlib import Path

from scalevec_train.data.config import DataConfig
from scalevec_train.data.tokenizer import Tokenizer
from scalevec_train.tasks import next_line
from scalevec_train.tasks.config import TaskConfig, TasksConfig
from scalevec_train.tasks.formats import Item, read_items
from scalevec_train.tasks.scoring import EncodedTask, encode_task

log = logging.getLogger(__name__)


def task_items(task: TaskConfig, folder: Path, data: DataConfig) -> list[Item]:
    if task.format == "next_line":
        return next_line.generate(next_line.held_out_documents(data), task.limit, task.num_choices)
    return read_items(task, folder)


def load_tasks(cfg: TasksConfig, data: DataConfig, tok: Tokenizer,
               max_len: int) -> list[EncodedTask]:
    """Every task of `cfg`, tokenized for sequences the model reads of at most `max_len` tokens."""
    tasks = []
    for task in cfg.items:
        items = task_items(task, Path(cfg.dir), data)
        tasks.append(encode_task(task.name, items, tok, max_len))
        log.info("task %s (%s): %d items, chance %.3f", task.name, task.format, len(items),
                 tasks[-1].chance)
    return tasks

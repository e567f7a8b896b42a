"""The downstream tasks' options (`tasks.*`): which tasks, and how often the training loop scores
them."""

from dataclasses import dataclass, field
from typing import Literal

from scalevec_train.infra.errors import ScalevecError, check_choices, choice

# Formats whose items come from a file (the others are generated): tasks.items[].path is required.
FILE_FORMATS = ("jsonl", "hellaswag", "arc", "piqa")


@dataclass
class TaskConfig:
    # the task's name in metric keys (task/<name>/acc, ...)
    name: str = ""
    # jsonl ({"context": str, "choices": [str], "label": int}, choices scored as written) |
    # hellaswag (ctx_a/ctx_b/activity_label/endings/label, lm-eval's preprocessing) | arc (question,
    # choices {text, label}, answerKey; also the original {"question": {"stem", "choices"}}
    # layout) | piqa (goal/sol1/sol2 with a label field or tasks.items[].labels) | next_line
    # (generated from the held-out documents of the run's corpus, no file:
    # docs/guides/experiments.md, "Downstream tasks")
    format: str = choice("jsonl", Literal["jsonl", "hellaswag", "arc", "piqa", "next_line"])
    # the task's file (JSON lines); relative paths are under tasks.dir
    path: str = ""
    # piqa only: a file of labels, one per line, for a file without a label field
    # (PIQA's *-labels.lst)
    labels: str = ""
    # score the first this many items (next_line: generate this many); 0: all
    limit: int = 0
    # next_line only: choices per item (the true line and num_choices - 1 others; chance
    # 1 / num_choices)
    num_choices: int = 4


@dataclass
class TasksConfig:
    # the tasks to score (configs/tasks/*.yaml: none, embedded, standard); empty: none
    items: list[TaskConfig] = field(default_factory=list)
    # score every this many steps (and at the first and last step); 0: only at the first and last
    every: int = 0
    # context + choice sequences per forward pass on one rank (their logits,
    # sequences x longest x vocabulary, are held at once: lower it for a large vocabulary)
    batch_size: int = 32
    # the folder that relative task paths are under
    dir: str = "data/tasks"

    def validate(self) -> None:
        names = [t.name for t in self.items]
        for i, task in enumerate(self.items):
            where = f"tasks.items[{i}]"
            check_choices(task, where + ".")
            if not task.name or "/" in task.name:
                raise ScalevecError(f"{where}.name", f"{task.name!r} cannot name a task in "
                                    "metric keys.",
                                    "give a non-empty name without '/'.")
            if names.count(task.name) > 1:
                raise ScalevecError(f"{where}.name", f"{task.name!r} names two tasks.",
                                    "give each a name of its own.")
            if (task.format in FILE_FORMATS) != bool(task.path):
                fix = ("point it at the task's JSON lines file." if task.format in FILE_FORMATS
                       else "clear it.")
                raise ScalevecError(f"{where}.path", f"format {task.format} "
                                    f"{'needs' if not task.path else 'takes no'} path.", fix)
            if task.labels and task.format != "piqa":
                raise ScalevecError(f"{where}.labels", f"format {task.format} reads its labels "
                                    "from its file.",
                                    "clear it (a labels file is for piqa).")
            if task.limit < 0 or task.num_choices < 2:
                raise ScalevecError(f"{where}.{'limit' if task.limit < 0 else 'num_choices'}",
                                    "limit must be >= 0 and num_choices >= 2.",
                                    "use 0 for no limit.")
        if self.every < 0 or self.batch_size < 1:
            raise ScalevecError("tasks.every" if self.every < 0 else "tasks.batch_size",
                                "every must be >= 0 and batch_size >= 1.",
                                "use tasks.every=0 to score only at the first and last step.")

"""Multiple-choice items from the JSON-lines layouts tasks are distributed in, as scalevec scores
them: a context, choices that each continue it, and the index of the right one.

Contexts, choices and delimiters are lm-evaluation-harness's (0.4, its arc_easy/arc_challenge, piqa
and hellaswag tasks, zero-shot): its doc_to_text is the context, its doc_to_choice the choices and
its target_delimiter " " what joins them. ARC and PIQA ask "Question: ...\\nAnswer:"; HellaSwag's
context is its activity label and both context parts, and its context and endings are cleaned of
WikiHow's bracketed markup as the harness's preprocess does.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.tasks.config import TaskConfig


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int
    # what joins the context and each choice (the harness's target_delimiter): scored with the
    # choice, but not counted in the choice's length that acc_norm divides by
    delimiter: str = ""


def read_items(task: TaskConfig, folder: Path) -> list[Item]:
    """The items of a file task (the first task.limit of them when set); relative paths under
    `folder`."""
    path = _resolve(task.path, folder, task.name)
    rows = _json_lines(path)
    if task.format == "piqa" and task.labels:
        labels = _resolve(task.labels, folder, task.name).read_text().split()
        if len(labels) != len(rows):
            raise ScalevecError(str(path), f"has {len(rows)} items but {task.labels} has "
                                f"{len(labels)} labels.",
                                "pair each task file with its own labels file.")
        rows = [{**row, "label": label} for row, label in zip(rows, labels, strict=True)]
    if task.limit:
        rows = rows[:task.limit]
    parse = _PARSERS[task.format]
    items = []
    for n, row in enumerate(rows, 1):
        try:
            item = parse(row)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScalevecError(f"{path}:{n}", f"is not a {task.format} item "
                                f"({type(e).__name__}: {e}).",
                                f"check the format of task {task.name!r} (jsonl, hellaswag, "
                                "arc, piqa).") from None
        check_item(item, f"{path}:{n}")
        items.append(item)
    if not items:
        raise ScalevecError(str(path), "holds no items.",
                            "point the task at a non-empty JSON lines file.")
    return items


def check_item(item: Item, where: str) -> None:
    if len(item.choices) < 2 or not all(item.choices):
        raise ScalevecError(where, "needs at least two non-empty choices.", "fix or drop the item.")
    if not 0 <= item.label < len(item.choices):
        raise ScalevecError(where, f"label {item.label} is not the index of one of its "
                            f"{len(item.choices)} choices.",
                            "use a 0-based index (HellaSwag, PIQA) or a choice label (ARC).")


def _resolve(name: str, folder: Path, task: str) -> Path:
    path = Path(name) if Path(name).is_absolute() else folder / name
    if not path.is_file():
        raise ScalevecError(f"task {task!r}", f"{path} does not exist.",
                            "put the task's file there, or set tasks.dir / the task's path.")
    return path


def _json_lines(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ScalevecError(f"{path}:{n}", f"is not JSON ({e.msg}).",
                                    "give one JSON object per line.") from None
    return rows


def _generic(row: dict) -> Item:
    return Item(row["context"], tuple(row["choices"]), int(row["label"]))


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict) -> Item:
    context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_text(row["activity_label"] + ": " + context)
    return Item(query, tuple(_hellaswag_text(e) for e in row["endings"]), int(row["label"]), " ")


def _arc(row: dict) -> Item:
    question = row["question"]
    if isinstance(question, dict):  # the original release: {"stem", "choices": [{"text", "label"}]}
        choices = question["choices"]
        texts, labels = [c["text"] for c in choices], [c["label"] for c in choices]
        question = question["stem"]
    else:  # the Hugging Face layout: choices {"text": [...], "label": [...]}
        texts, labels = row["choices"]["text"], row["choices"]["label"]
    return Item(f"Question: {question}\nAnswer:", tuple(texts), labels.index(row["answerKey"]), " ")


def _piqa(row: dict) -> Item:
    return Item(f"Question: {row['goal']}\nAnswer:", (row["sol1"], row["sol2"]), int(row["label"]),
                " ")


_PARSERS = {"jsonl": _generic, "hellaswag": _hellaswag, "arc": _arc, "piqa": _piqa}

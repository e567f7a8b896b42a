"""Scoring multiple-choice items by the log-likelihood of each choice given its context.

Per item: the summed log-probability of each choice's tokens after its context, and from those
    acc       the share of items whose right choice has the highest summed log-probability,
    acc_norm  the same, per UTF-8 byte of each choice (lm-evaluation-harness divides by characters:
              the same for ASCII; bytes are the unit val_bpb counts in),
    bpb       bits per byte of the right choices: -(their summed log-probabilities) / ln 2 / (their
              bytes), over all items (a ratio of sums, as val_bpb): smooth where accuracy moves in steps,
    chance    the accuracy of guessing: the mean over items of 1 / (their number of choices).
Each choice is one sequence, [EOS] + context + choice, as a document starts in the training stream;
context and choice are tokenized apart, and a long context loses its beginning to fit `max_len`.

Items are dealt to ranks by index (item i to rank i % world); the per-choice sums, each written by one
rank, are summed over ranks, so every rank holds all of them and the metrics do not depend on the
number of ranks. Every rank runs the same number of forward passes (FSDP gathers weights in each).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scalevec_train.data.loader import IGNORE
from scalevec_train.data.tokenizer import Tokenizer
from scalevec_train.errors import ScalevecError
from scalevec_train.parallel.process_group import all_reduce_sum
from scalevec_train.tasks.formats import Item

METRICS = ("acc", "acc_norm", "bpb", "chance")


@dataclass
class EncodedTask:
    """A task's items as token sequences, one per choice."""

    name: str
    rows: list[list[int]]  # one per choice: the tokens the model reads, and the last choice token
    starts: list[int]  # where in its row the choice's tokens start
    items: list[int]  # the item of each row
    cells: list[int]  # the row's place in the items x width table: item * width + choice
    labels: torch.Tensor  # [items] the right choice's index
    choice_bytes: torch.Tensor  # [items, width] float64 UTF-8 bytes of each choice (0: no such choice)
    chance: float

    @property
    def width(self) -> int:
        return self.choice_bytes.shape[1]


def encode_task(name: str, items: list[Item], tok: Tokenizer, max_len: int) -> EncodedTask:
    """Tokenizes `items` into sequences of at most max_len + 1 tokens (max_len: what the model reads)."""
    width = max(len(item.choices) for item in items)
    contexts = tok.encode([item.context for item in items])
    choices = tok.encode([choice for item in items for choice in item.choices])
    prefix = [tok.eos_id()] if tok.eos_id() >= 0 else []
    rows, starts, owners, cells = [], [], [], []
    choice_bytes = torch.zeros(len(items), width, dtype=torch.float64)
    flat = iter(choices)
    for i, (item, context) in enumerate(zip(items, contexts, strict=True)):
        for c, text in enumerate(item.choices):
            ids = next(flat)
            if not ids or len(ids) >= max_len:
                raise ScalevecError(f"task {name!r}", f"item {i}'s choice {c} is {len(ids)} tokens: the model reads "
                                    f"at most {max_len} (train.seq_len), context included.",
                                    "use a longer train.seq_len, or drop the item.")
            keep = (prefix + context)[-(max_len + 1 - len(ids)):]
            if not keep:
                raise ScalevecError(f"task {name!r}", f"item {i} has an empty context, and the tokenizer no EOS "
                                    "to start it with.", "give every item a context.")
            rows.append(keep + ids)
            starts.append(len(keep))
            owners.append(i)
            cells.append(i * width + c)
            choice_bytes[i, c] = len(text.encode())
    labels = torch.tensor([item.label for item in items])
    chance = sum(1 / len(item.choices) for item in items) / len(items)
    return EncodedTask(name, rows, starts, owners, cells, labels, choice_bytes, chance)


@torch.no_grad()
def choice_logprobs(model: torch.nn.Module, task: EncodedTask, device: torch.device, autocast, batch_size: int,
                    rank: int = 0, world: int = 1) -> torch.Tensor:
    """[items, width] float64 on the device: each choice's summed log-probability (-inf: no such choice),
    the same on every rank. Runs the model in eval mode and leaves it in the mode it found it in."""
    mine = [r for r in range(len(task.rows)) if task.items[r] % world == rank]
    mine.sort(key=lambda r: -len(task.rows[r]))  # rows of like length share a batch: less padding
    most = max(sum(1 for owner in task.items if owner % world == k) for k in range(world))
    training = model.training
    model.eval()
    sums = torch.zeros(task.labels.numel() * task.width, dtype=torch.float64, device=device)
    for b in range(math.ceil(most / batch_size)):
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        if not chunk:  # this rank's items are done; its peers' forwards still need its part of the weights
            with autocast():
                model(torch.zeros(1, 1, dtype=torch.long, device=device))
            continue
        length = max(len(task.rows[r]) for r in chunk) - 1
        inputs = torch.zeros(len(chunk), length, dtype=torch.long)
        targets = torch.full((len(chunk), length), IGNORE, dtype=torch.long)
        for j, r in enumerate(chunk):
            row, start = task.rows[r], task.starts[r]
            inputs[j, :len(row) - 1] = torch.tensor(row[:-1])
            targets[j, start - 1:len(row) - 1] = torch.tensor(row[start:])
        with autocast():
            logits = model(inputs.to(device))
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), reduction="none")
        sums[torch.tensor([task.cells[r] for r in chunk], device=device)] = -nll.view(len(chunk), -1).double().sum(1)
    model.train(training)
    scores = all_reduce_sum(sums).view(-1, task.width)
    return scores.masked_fill(task.choice_bytes.to(device) == 0, -math.inf)


def task_metrics(scores: torch.Tensor, task: EncodedTask) -> dict[str, torch.Tensor | float]:
    """acc, acc_norm and bpb (0-dim device tensors: nothing is read back) and chance, from the
    per-choice log-probabilities (choice_logprobs)."""
    labels = task.labels.to(scores.device)
    per_byte = scores / task.choice_bytes.to(scores.device).clamp(min=1)
    right = scores.gather(1, labels[:, None]).squeeze(1)
    right_bytes = float(task.choice_bytes.gather(1, task.labels[:, None]).sum())
    return {"acc": (scores.argmax(1) == labels).double().mean(),
            "acc_norm": (per_byte.argmax(1) == labels).double().mean(),
            "bpb": -right.sum() / math.log(2) / right_bytes,
            "chance": task.chance}


def score(model: torch.nn.Module, task: EncodedTask, device: torch.device, autocast, batch_size: int,
          rank: int = 0, world: int = 1) -> dict[str, torch.Tensor | float]:
    """The metrics of one task (see the module docstring)."""
    return task_metrics(choice_logprobs(model, task, device, autocast, batch_size, rank, world), task)

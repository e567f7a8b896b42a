"""Scoring multiple-choice items by the log-likelihood of each choice given its context, as
lm-evaluation-harness scores a multiple_choice task with a Hugging Face model
(0.4, HFLM, zero-shot).

Per item and choice, the harness's loglikelihood(context, delimiter + choice):
    - whitespace that ends the context moves to the front of the continuation;
    - the context's tokens are those of the context alone, the continuation's are those of context +
      continuation past that many tokens (the two strings encoded whole, then split);
    - nothing precedes the context (the export's tokenizer adds no BOS); an empty context is EOS
      alone;
    - context + continuation lose tokens from the left to fit max_len + 1 (max_len: the model's
      positions, the export's max_position_embeddings);
    - the score is the continuation tokens' summed log-probability.
From those:
    acc       the share of items whose right choice has the highest score,
    acc_norm  the same, each score divided by the choice's length in characters (without the
              delimiter, as the harness's acc_norm),
    bpb       bits per byte of the right choices: -(their summed scores) / ln 2 / (the UTF-8 bytes
              of their continuations), over all items (a ratio of sums, as val_bpb): smooth where
              accuracy moves in steps,
    chance    the accuracy of guessing: the mean over items of 1 / (their number of choices).
Ties go to the first choice, as numpy's argmax.

Items are dealt to ranks by index (item i to rank i % world); the per-choice sums, each written by
one rank, are summed over ranks, so every rank holds all of them and the metrics do not depend on
the number of ranks. Every rank runs the same number of forward passes (FSDP gathers weights in
each).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scalevec_train.data.loader import IGNORE
from scalevec_train.data.tokenizer import Tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.parallel.process_group import all_reduce_sum
from scalevec_train.tasks.formats import Item

METRICS = ("acc", "acc_norm", "bpb", "chance")


@dataclass
class EncodedTask:
    """A task's items as token sequences, one per choice."""

    name: str
    # one per choice: the tokens the model reads, and the last continuation token
    rows: list[list[int]]
    starts: list[int]  # where in its row the continuation's tokens start
    items: list[int]  # the item of each row
    cells: list[int]  # the row's place in the items x width table: item * width + choice
    labels: torch.Tensor  # [items] the right choice's index
    # [items, width] float64 characters of each choice (0: no such choice)
    choice_chars: torch.Tensor
    right_bytes: int  # UTF-8 bytes of the right choices' continuations, summed
    chance: float

    @property
    def width(self) -> int:
        return self.choice_chars.shape[1]


def encode_task(name: str, items: list[Item], tok: Tokenizer, max_len: int) -> EncodedTask:
    """Tokenizes `items` into sequences of at most max_len + 1 tokens (max_len: what the model
    reads)."""
    width = max(len(item.choices) for item in items)
    # the harness's split: trailing whitespace of the context belongs to the continuation
    contexts = [item.context.rstrip() for item in items]
    continuations = [[item.context[len(ctx):] + item.delimiter + choice for choice in item.choices]
                     for item, ctx in zip(items, contexts, strict=True)]
    context_ids = tok.encode(contexts)
    whole_ids = iter(
        tok.encode([ctx + cont for ctx, conts in zip(contexts, continuations, strict=True)
                    for cont in conts]))
    rows, starts, owners, cells = [], [], [], []
    choice_chars = torch.zeros(len(items), width, dtype=torch.float64)
    right_bytes = 0
    # the harness's empty context: end-of-text alone
    empty = [tok.eos_id()] if tok.eos_id() >= 0 else []
    for i, (item, ctx_ids, conts) in enumerate(zip(items, context_ids, continuations, strict=True)):
        for c, (choice, cont) in enumerate(zip(item.choices, conts, strict=True)):
            whole = next(whole_ids)
            context, ids = (ctx_ids, whole[len(ctx_ids):]) if item.context else (empty, whole)
            if not context or not ids or len(ids) > max_len:
                raise ScalevecError(f"task {name!r}", f"item {i}'s choice {c}: "
                                    f"{_unscorable(context, ids, max_len)}.",
                                    "fix or drop the item (or raise model.max_seq_len).")
            row = (context + ids)[-(max_len + 1):]
            rows.append(row)
            starts.append(len(row) - len(ids))
            owners.append(i)
            cells.append(i * width + c)
            choice_chars[i, c] = len(choice)
            if c == item.label:
                right_bytes += len(cont.encode())
    labels = torch.tensor([item.label for item in items])
    chance = sum(1 / len(item.choices) for item in items) / len(items)
    return EncodedTask(name, rows, starts, owners, cells, labels, choice_chars, right_bytes, chance)


def _unscorable(context: list[int], ids: list[int], max_len: int) -> str:
    if not context:
        return "its context has no tokens (it is whitespace, or empty with no EOS to stand for it)"
    if not ids:
        return "context + choice encode to no more tokens than the context alone"
    return f"the choice is {len(ids)} tokens; the model reads at most {max_len} (model.max_seq_len)"


@torch.no_grad()
def choice_logprobs(model: torch.nn.Module, task: EncodedTask, device: torch.device, autocast,
                    batch_size: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """[items, width] float64 on the device: each choice's summed log-probability
    (-inf: no such choice), the same on every rank. Runs the model in eval mode and leaves it in the
    mode it found it in."""
    mine = [r for r in range(len(task.rows)) if task.items[r] % world == rank]
    mine.sort(key=lambda r: -len(task.rows[r]))  # rows of like length share a batch: less padding
    most = max(sum(1 for owner in task.items if owner % world == k) for k in range(world))
    training = model.training
    model.eval()
    sums = torch.zeros(task.labels.numel() * task.width, dtype=torch.float64, device=device)
    for b in range(math.ceil(most / batch_size)):
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        # this rank's items are done; its peers' forwards still need its part of the weights
        if not chunk:
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
        nll = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(),
                              reduction="none")
        sums[torch.tensor([task.cells[r] for r in chunk], device=device)] = -nll.view(
            len(chunk), -1).double().sum(1)
    model.train(training)
    scores = all_reduce_sum(sums).view(-1, task.width)
    return scores.masked_fill(task.choice_chars.to(device) == 0, -math.inf)


def task_metrics(scores: torch.Tensor, task: EncodedTask) -> dict[str, torch.Tensor | float]:
    """acc, acc_norm and bpb (0-dim device tensors: nothing is read back) and chance, from the
    per-choice log-probabilities (choice_logprobs)."""
    labels = task.labels.to(scores.device)
    per_char = scores / task.choice_chars.to(scores.device).clamp(min=1)
    right = scores.gather(1, labels[:, None]).squeeze(1)
    return {"acc": (scores.argmax(1) == labels).double().mean(),
            "acc_norm": (per_char.argmax(1) == labels).double().mean(),
            "bpb": -right.sum() / math.log(2) / task.right_bytes,
            "chance": task.chance}


def score(model: torch.nn.Module, task: EncodedTask, device: torch.device, autocast,
          batch_size: int, rank: int = 0, world: int = 1) -> dict[str, torch.Tensor | float]:
    """The metrics of one task (see the module docstring)."""
    return task_metrics(choice_logprobs(model, task, device, autocast, batch_size, rank, world),
                        task)

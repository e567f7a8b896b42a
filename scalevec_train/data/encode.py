"""Encoding batches of documents on every core: worker processes encode, results come back in the
order the batches went in whatever order the workers finish in, and at most a few batches per worker
are in flight, so memory stays bounded however large the corpus. Each worker encodes one text at a
time on one thread, so the token ids never depend on the number of workers.
"""

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from scalevec_train.data import tokenizer
from scalevec_train.data.split import SPLITS, ValSplit

_IN_FLIGHT = 2  # batches per worker handed out ahead of the one being written


@dataclass(frozen=True)
class Batch:
    part: int  # the part (parts.py) its documents belong to
    keys: list[str]
    texts: list[str]


@dataclass(frozen=True)
class Encoded:
    part: int
    # split -> uint32 ids of its documents, each followed by the eos id
    tokens: dict[str, np.ndarray]
    documents: dict[str, int]  # split -> documents with at least one token (empty ones are dropped)


class Encoder:
    def __init__(self, tokenizer_path: Path, split: ValSplit):
        self.tokenizer = tokenizer.load(tokenizer_path)
        self.eos = self.tokenizer.eos_id()
        self.split = split

    def __call__(self, batch: Batch) -> Encoded:
        ids: dict[str, list[int]] = {s: [] for s in SPLITS}
        documents = dict.fromkeys(SPLITS, 0)
        for key, text in zip(batch.keys, batch.texts, strict=True):
            doc = self.tokenizer.encode(text)
            if not doc:
                continue
            s = "val" if self.split.is_val(key) else "train"
            ids[s] += doc
            ids[s].append(self.eos)
            documents[s] += 1
        return Encoded(batch.part, {s: np.array(v, dtype=np.uint32) for s, v in ids.items()},
                       documents)


def available_cores() -> int:
    """The CPU cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def encode_batches(batches: Iterable[Batch], tokenizer_path: Path, split: ValSplit,
                   workers: int) -> Iterator[Encoded]:
    """Each batch encoded, in order; by `workers` processes (one: in this process)."""
    batches = iter(batches)
    head = list(islice(batches, 2))
    if workers == 1 or len(head) < 2:  # one batch is encoded before workers would have started
        yield from map(Encoder(tokenizer_path, split), chain(head, batches))
        return
    # spawn, not fork: the caller may hold threads (torch's, a tokenizer's) that a fork would break
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, context, initializer=_start_worker,
                             initargs=(tokenizer_path, split)) as pool:
        pending = deque()
        try:
            for batch in chain(head, batches):
                pending.append(pool.submit(_encode, batch))
                if len(pending) >= _IN_FLIGHT * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


_encoder: Encoder | None = None  # a worker process's own


def _start_worker(tokenizer_path: Path, split: ValSplit) -> None:
    global _encoder
    _encoder = Encoder(tokenizer_path, split)


def _encode(batch: Batch) -> Encoded:
    return _encoder(batch)

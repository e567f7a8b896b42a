"""Shards written in parts, by one process or many, and merged into a prepared folder.

The documents, in corpus order, are cut into parts of about data.part_bytes bytes of text: a part
ends with the document that reaches that size. Of the `world` processes preparing together (one; or
those of a torchrun job or a SLURM array, on any nodes that share the cache), process `rank` encodes
parts rank, rank + world, ...; it steps over the documents of the others by their size, without
reading them. Each part's tokens go to shard files of a folder of its own, renamed into place when
complete, so that a killed preparation resumes from the parts it finished. Once every part is there,
one process (under the cache lock: the last to finish) merges: it links the parts' shards, numbered
in corpus order, into the prepared folder and writes the manifests. Parts and shards are the same
for any number of processes and workers, so the prepared folder is too.

Staging, beside the prepared folder <root>, until the merge removes it:
    .<root>.<part_bytes>.parts/part-00007/{train,val}/NNNNN.bin, part.json   a finished part
    .<root>.<part_bytes>.parts/count.json                                    the number of parts
"""

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from scalevec_train.data import tokenizer
from scalevec_train.data.corpus import Document
from scalevec_train.data.encode import Batch, Encoded, encode_batches
from scalevec_train.data.shards import ShardWriter, shard_name, write_manifest
from scalevec_train.data.split import SPLITS, ValSplit
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import fault_point

log = logging.getLogger(__name__)

_BATCH_CHARS = 1 << 22  # documents go to the workers in batches of about this many characters
_RECORD, _COUNT = "part.json", "count.json"


def staging_dir(root: Path, part_bytes: int) -> Path:
    # part_bytes in the name: parts cut at another size never mix
    return root.parent / f".{root.name}.{part_bytes}.parts"


def part_dir(staging: Path, part: int) -> Path:
    return staging / f"part-{part:05d}"


class Cutter:
    """The batches of the documents of this process's unfinished parts: each within one part, and at
    least one per part (an empty one for a part without text, which is written all the same).
    `parts` is the number of parts once the documents are exhausted."""

    def __init__(self, documents: Iterator[Document], part_bytes: int, mine: Callable[[int], bool]):
        self.documents, self.part_bytes, self.mine = documents, part_bytes, mine
        self.parts = 0

    def __iter__(self) -> Iterator[Batch]:
        part, filled, mine = 0, 0, self.mine(0)
        keys, texts, chars = [], [], 0
        for doc in self.documents:
            if filled >= self.part_bytes:
                if mine:
                    yield Batch(part, keys, texts)
                    keys, texts, chars = [], [], 0
                part, filled = part + 1, 0
                mine = self.mine(part)
            filled += doc.size
            if mine:
                text = doc.read()
                keys.append(doc.key)
                texts.append(text)
                chars += len(text)
                if chars >= _BATCH_CHARS:
                    yield Batch(part, keys, texts)
                    keys, texts, chars = [], [], 0
        if mine:
            yield Batch(part, keys, texts)
        self.parts = part + 1


class PartWriter:
    """One part's shards and record, built in a temporary folder and renamed into place by
    finish()."""

    def __init__(self, staging: Path, part: int, vocab_size: int, shard_tokens: int, rank: int = 0):
        self.part, self.final, self.rank = part, part_dir(staging, part), rank
        self.tmp = Path(tempfile.mkdtemp(dir=staging, prefix=f".{self.final.name}."))
        self.writers = {s: ShardWriter(self.tmp / s, vocab_size, shard_tokens) for s in SPLITS}
        self.documents = dict.fromkeys(SPLITS, 0)

    def add(self, encoded: Encoded) -> None:
        written = sum(len(w.shards) for w in self.writers.values())
        for s in SPLITS:
            self.writers[s].add(encoded.tokens[s])
            self.documents[s] += encoded.documents[s]
        if not written and any(w.shards for w in self.writers.values()):
            fault_point("prepare.shards", self.part, self.rank)

    def finish(self) -> None:
        record = {s: {"shards": self.writers[s].finish(), "num_documents": self.documents[s]}
                  for s in SPLITS}
        (self.tmp / _RECORD).write_text(json.dumps(record))
        fault_point("prepare.part", self.part, self.rank)
        try:
            os.rename(self.tmp, self.final)
        except OSError:
            if not self.final.is_dir():
                raise
            # Another process finished the same part first; its folder is equally valid.
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def encode_parts(documents: Iterator[Document], split: ValSplit, tok_path: Path, staging: Path,
                 part_bytes: int, shard_tokens: int, vocab_size: int, rank: int, world: int,
                 workers: int) -> None:
    """Writes this process's parts that are not in `staging` yet, then the number of parts."""
    staging.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cutter = Cutter(documents, part_bytes,
                    lambda p: p % world == rank and not part_dir(staging, p).is_dir())
    writer, written = None, 0
    try:
        for encoded in encode_batches(cutter, tok_path, split, workers):
            if writer is None or encoded.part != writer.part:
                if writer is not None:
                    writer.finish()
                    written += 1
                writer = PartWriter(staging, encoded.part, vocab_size, shard_tokens, rank)
            writer.add(encoded)
        if writer is not None:
            writer.finish()
            written += 1
    finally:
        if writer is not None:
            writer.discard()
    fault_point("prepare.count", 0, rank)
    tokenizer.write_atomic(staging / _COUNT, json.dumps({"parts": cutter.parts}).encode())
    log.info("process %d of %d: encoded %d of %d parts in %.1fs (workers: %d)", rank, world,
             written, cutter.parts, time.perf_counter() - start, workers)


def merge(staging: Path, root: Path, tok_path: Path, tok_hash: str, vocab_size: int, eos: int,
          corpus_info: dict, rank: int = 0) -> bool:
    """Builds `root` from the parts in `staging` if all are there (False if not); the caller holds
    the cache lock. The folder appears whole or not at all: a merge killed midway leaves its
    temporary folder, which the next merge removes."""
    if not (staging / _COUNT).is_file():
        return False
    count = json.loads((staging / _COUNT).read_text())["parts"]
    if not all((part_dir(staging, p) / _RECORD).is_file() for p in range(count)):
        return False
    records = [json.loads((part_dir(staging, p) / _RECORD).read_text()) for p in range(count)]
    documents = {s: sum(r[s]["num_documents"] for r in records) for s in SPLITS}
    if documents["train"] == 0:
        raise ScalevecError("data", "empty corpus: no training document holds any text.",
                            "point data.source/data.path at text.")
    if documents["val"] == 0:
        raise ScalevecError("data.val_fraction",
                            "no document with text fell into the validation split.",
                            "raise data.val_fraction or add documents.")
    for stale in root.parent.glob(f".{root.name}.*"):
        # a killed merge's (no other runs now)
        if stale != staging and not stale.name.endswith(".parts"):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        tokenizer.install(tok_path, tmp)
        for s in SPLITS:
            (tmp / s).mkdir()
            shards = []
            for p, record in enumerate(records):
                for shard in record[s]["shards"]:
                    name = shard_name(len(shards))
                    _link(part_dir(staging, p) / s / shard["name"], tmp / s / name)
                    shards.append({**shard, "name": name})  # its token count and checksum
            fault_point("prepare.links", SPLITS.index(s), rank)
            m = write_manifest(tmp / s, vocab_size, tok_hash, shards, split=s,
                               num_documents=documents[s], eos_id=eos, corpus=corpus_info)
            log.info("%s: %d documents, %d tokens", s, documents[s], m["num_tokens"])
        fault_point("prepare.rename", 0, rank)
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.is_dir():
                raise
            # Another process merged first; its folder is equally valid.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fault_point("prepare.cleanup", 0, rank)
    shutil.rmtree(staging, ignore_errors=True)
    log.info("merged %d parts into %s", count, root)
    return True


def _link(src: Path, dst: Path) -> None:
    """A second name for a shard (the parts stay whole until the merge is complete), or a copy where
    the file system has no hard links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def launch_processes(env: dict[str, str]) -> tuple[int, int, int]:
    """(rank, world size, processes on this node) of the preparation this process takes part in."""
    if "WORLD_SIZE" in env:
        rank, world, local = (int(env.get("RANK", 0)), int(env["WORLD_SIZE"]),
                              int(env.get("LOCAL_WORLD_SIZE", 1)))
    elif "SLURM_ARRAY_TASK_COUNT" in env:
        rank = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN", 0))
        world, local = int(env["SLURM_ARRAY_TASK_COUNT"]), 1
    else:
        return 0, 1, 1
    if not 0 <= rank < world:
        raise ScalevecError("process", f"rank {rank} is outside [0, {world}).",
                            "launch under torchrun, or as a SLURM array with consecutive task ids "
                            "(--array=0-N).")
    return rank, world, local

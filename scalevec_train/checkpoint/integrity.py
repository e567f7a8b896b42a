"""The checksums of a checkpoint's files: recorded when it is written, checked before it is read.

checksums.json holds the size and checksum (scalevec_train/infra/checksums.py) of every other file
of the checkpoint folder, and the COMPLETE marker holds the checksum of checksums.json: a byte that
changed anywhere (a shard, .metadata, train_state.json, an RNG file, the list, the marker) shows
before any file is parsed. Each rank hashes the shard files it wrote (an asynchronous save: in its
writing thread, once the write is done) and its RNG file; rank 0 hashes the rest when it completes
the save (manager.py).

The checks run where a checkpoint is read back: resume and branch_from (checkpoint.verify; the ranks
share the reading), scalevec_train.load (and so export and evaluate), average, and `python -m
scalevec_train.verify`. A checkpoint written before checksums were recorded (an empty COMPLETE and
no checksums.json) is read as it is, after a one-line notice.
"""

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scalevec_train.checkpoint.files import COMPLETE, checkpoint_step, complete_checkpoints
from scalevec_train.infra.checksums import ALGORITHM, digest, file_digest
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.parallel.process_group import (
    broadcast_object,
    gather_all,
    is_main,
    rank,
    world_size,
)

CHECKSUMS = "checksums.json"
_MARKER = re.compile(rb"(\w+) ([0-9a-f]{16})\n")


def rank_shards(folder: Path, rank_: int) -> list[str]:
    """The shard files rank `rank_` wrote into `folder` (DCP's FileSystemWriter names them
    __<rank>_<n>.distcp; a file of another name is hashed by rank 0 when it seals the folder)."""
    return sorted(p.name for p in folder.glob(f"__{rank_}_*.distcp"))


def entry(size: int, checksum: str) -> dict:
    """A file's record in checksums.json."""
    return {"bytes": size, ALGORITHM: checksum}


def hash_files(folder: Path, names: list[str]) -> dict[str, dict]:
    """The records of files `names` of `folder`, read back from the storage."""
    return {name: entry((folder / name).stat().st_size, file_digest(folder / name))
            for name in names}


def seal(folder: Path, hashed: dict[str, dict]) -> None:
    """Once every file of checkpoint `folder` is written: checksums.json (the records `hashed`, and
    those of the folder's other files, hashed here), then COMPLETE holding its checksum."""
    files = dict(hashed)
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name not in files and path.name not in (COMPLETE, CHECKSUMS):
            files.update(hash_files(folder, [path.name]))
    text = json.dumps({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))},
                      indent=1).encode()
    (folder / CHECKSUMS).write_bytes(text)
    (folder / COMPLETE).write_bytes(f"{ALGORITHM} {digest(text)}\n".encode())


@dataclass
class Verdict:
    """What one rank found checking its share of a checkpoint's files."""

    recorded: bool  # False: written before checksums were recorded (nothing to check)
    # (file, problem), one per bad file
    problems: list[tuple[str, str]] = field(default_factory=list)
    files: int = 0  # files checked
    bytes: int = 0  # bytes read


def check(folder: Path, rank_: int = 0, world: int = 1) -> Verdict:
    """Checks checkpoint `folder`: the marker and the list (every rank), and the files of share
    `rank_` of `world` (the largest first, dealt out in turn), every one of them, whatever the first
    found."""
    marker, listing = folder / COMPLETE, folder / CHECKSUMS
    try:
        mark = marker.read_bytes()
    except OSError as e:
        return Verdict(True, [(str(marker), f"cannot be read ({e.strerror}).")])
    if not mark and not listing.exists():
        return Verdict(False)
    found = _MARKER.fullmatch(mark)
    if found is None or found[1].decode() != ALGORITHM:
        return Verdict(True, [(str(marker), f"holds {mark[:40]!r}, "
                               f"not '{ALGORITHM} <checksum of {CHECKSUMS}>'.")])
    try:
        text = listing.read_bytes()
    except OSError as e:
        return Verdict(True, [(str(listing), f"cannot be read ({e.strerror}).")])
    if digest(text) != found[2].decode():
        return Verdict(True, [(str(listing), f"does not match the checksum its marker {COMPLETE} "
                               f"holds ({found[2].decode()} recorded, {digest(text)} read): one of "
                               "the two changed after the checkpoint was written.")])
    files = json.loads(text)["files"]
    mine = sorted(files, key=lambda name: (-files[name]["bytes"], name))[rank_::world]
    verdict = Verdict(True, files=len(mine))
    for name in mine:
        problem = _check_file(folder / name, files[name])
        if problem:
            verdict.problems.append((str(folder / name), problem))
        verdict.bytes += files[name]["bytes"]
    return verdict


def _check_file(path: Path, record: dict) -> str | None:
    if not path.is_file():
        return "is missing."
    size = path.stat().st_size
    if size != record["bytes"]:
        cut = "truncated: " if size < record["bytes"] else ""
        return f"is {cut}{size} bytes, {record['bytes']} when it was written."
    now = file_digest(path)
    if now != record[ALGORITHM]:
        return (f"does not match the checksum recorded when it was written "
                f"({ALGORITHM} {record[ALGORITHM]} recorded, {now} read): its bytes changed since.")
    return None


def check_shared(folder: Path) -> Verdict:
    """check() with the files shared by the ranks, every rank's findings on every rank (every rank
    calls it)."""
    verdicts = gather_all(check(folder, rank(), world_size()))
    return Verdict(all(v.recorded for v in verdicts), [p for v in verdicts for p in v.problems],
                   sum(v.files for v in verdicts), sum(v.bytes for v in verdicts))


def verify(path: Path, use: Callable[[Path], str], trust: str) -> None:
    """Raises the same ScalevecError on every rank unless every file of checkpoint `path` matches
    its checksum: it names the first file that does not, and the newest earlier checkpoint of the
    run that verifies, with `use(that checkpoint)` and `trust` (how to skip the check) as the fix. A
    checkpoint without checksums passes with a notice. Every rank calls it."""
    verdict = check_shared(path)
    if not verdict.recorded:
        if is_main():
            print(f"note: {path} records no checksums (written before scalevec recorded them): "
                  "its files are read unverified.", file=sys.stderr)
        return
    if not verdict.problems:
        return
    where, problem = verdict.problems[0]
    good, unverified = None, None
    for older in reversed(broadcast_object(earlier(path))):
        found = check_shared(older)
        if found.recorded and not found.problems:
            good = older
            break
        if not found.recorded and unverified is None:
            unverified = older
    if good is not None:
        fix = f"{use(good)} (the newest earlier checkpoint that verifies)"
    elif unverified is not None:
        fix = (f"{use(unverified)} (no earlier checkpoint verifies; that one records no checksums "
               "to verify)")
    else:
        fix = "no earlier checkpoint of the run verifies: train it again"
    raise ScalevecError(where, problem, f"{fix}; or, if you trust {path} as it is, {trust}.")


def earlier(path: Path) -> list[Path]:
    """The complete checkpoints of the run of checkpoint `path` before it, oldest first (none for a
    folder outside a run's checkpoints/, such as an average)."""
    if path.parent.name != "checkpoints" or not path.name.startswith("step_"):
        return []
    return [p for p in complete_checkpoints(path.parent.parent)
            if checkpoint_step(p) < checkpoint_step(path)]

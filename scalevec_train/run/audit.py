"""Every checkpoint and every token shard under a folder checked against the checksums recorded when
it was written (the command: `python -m scalevec_train.verify`): a line each, `ok`, `MISMATCH` (with
the file and what is wrong) or `no checksums` (written before they were recorded). Folders whose
names start with a dot (saves and preparations in progress or interrupted) are skipped."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scalevec_train.checkpoint.files import COMPLETE
from scalevec_train.checkpoint.integrity import check
from scalevec_train.data.shards import MANIFEST, open_manifest, shard_mismatch
from scalevec_train.infra.checksums import ALGORITHM
from scalevec_train.infra.errors import ScalevecError

OK, MISMATCH, UNRECORDED = "ok", "MISMATCH", "no checksums"


def audit(path: Path) -> list[tuple[str, str]]:
    """(status, text) of every checkpoint and shard under `path`, in path order; raises when it
    holds neither."""
    checkpoints, splits = find(path) if path.is_dir() else ([], [])
    if not checkpoints and not splits:
        raise ScalevecError(str(path), f"holds no checkpoint ({COMPLETE} marker) and no token "
                            f"shards ({MANIFEST}).",
                            "pass a run directory, data.cache_dir, or one checkpoint or prepared "
                            "folder.")
    lines: list[tuple[str, str]] = []
    # The reads and the hash let go of the GIL: files are checked side by side, reported in order.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for found in pool.map(checkpoint_lines, checkpoints):
            lines += found
        for split_dir in splits:
            try:
                manifest = open_manifest(split_dir)
            # unreadable, or it names shards missing or of the wrong size
            except ScalevecError as e:
                lines.append((MISMATCH, f"{e.where}: {e.problem}"))
                continue
            lines += pool.map(lambda shard, where=split_dir: shard_line(where, shard),
                              manifest["shards"])
    return lines


def find(path: Path) -> tuple[list[Path], list[Path]]:
    """(checkpoint folders, shard split folders) under `path`, in path order."""
    checkpoints, splits = [], []
    for folder, subfolders, files in os.walk(path):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        if COMPLETE in files:
            checkpoints.append(Path(folder))
            subfolders.clear()  # an averaged folder's files are its own
        elif MANIFEST in files:
            splits.append(Path(folder))
    return checkpoints, splits


def checkpoint_lines(folder: Path) -> list[tuple[str, str]]:
    verdict = check(folder)
    if not verdict.recorded:
        return [(UNRECORDED, f"{folder}  (written before checksums were recorded)")]
    if verdict.problems:
        return [(MISMATCH, f"{where}: {problem}") for where, problem in verdict.problems]
    return [(OK, f"{folder}  ({verdict.files} files, {verdict.bytes / 1e6:.1f} MB)")]


def shard_line(split_dir: Path, shard: dict) -> tuple[str, str]:
    file = split_dir / shard["name"]
    if ALGORITHM not in shard:
        return UNRECORDED, f"{file}  (prepared before checksums were recorded)"
    problem = shard_mismatch(split_dir, shard)
    return (MISMATCH, f"{file}: {problem}") if problem else (OK, str(file))

"""`python -m scalevec_train.verify <path>`: every checkpoint and every token shard under `path` (a run
directory, a folder of runs, one checkpoint, an averaged folder, data.cache_dir or one prepared folder)
checked against the checksums recorded when it was written, one line each:

    ok            runs/x/checkpoints/step_000300  (6 files, 12.1 MB)
    MISMATCH      runs/x/checkpoints/step_000400/__0_0.distcp: does not match the checksum recorded ...
    no checksums  runs/old/checkpoints/step_000100  (written before checksums were recorded)
    ok            data_cache/stdlib-1a2b3c/train/00000.bin

Folders whose names start with a dot (saves and preparations in progress or interrupted) are skipped.
Exit code 0 when nothing mismatches, 1 when something does, 2 when `path` holds neither.
"""

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scalevec_train.checkpoint.files import COMPLETE
from scalevec_train.checkpoint.integrity import check
from scalevec_train.data.shards import MANIFEST, open_manifest, shard_mismatch
from scalevec_train.infra.checksums import ALGORITHM
from scalevec_train.infra.errors import ScalevecError

USAGE = "usage: python -m scalevec_train.verify <run_dir, data.cache_dir, or one checkpoint or prepared folder>"
OK, MISMATCH, UNRECORDED = "ok", "MISMATCH", "no checksums"


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


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    path = Path(argv[0])
    checkpoints, splits = find(path) if path.is_dir() else ([], [])
    if not checkpoints and not splits:
        print(f"error: {path}: holds no checkpoint ({COMPLETE} marker) and no token shards ({MANIFEST}). "
              "Fix: pass a run directory, data.cache_dir, or one checkpoint or prepared folder.", file=sys.stderr)
        return 2
    lines: list[tuple[str, str]] = []
    # The reads and the hash let go of the GIL: files are checked side by side, reported in order.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for found in pool.map(checkpoint_lines, checkpoints):
            lines += found
        for split_dir in splits:
            try:
                manifest = open_manifest(split_dir)
            except ScalevecError as e:  # unreadable, or it names shards missing or of the wrong size
                lines.append((MISMATCH, f"{e.where}: {e.problem}"))
                continue
            lines += pool.map(lambda shard, where=split_dir: shard_line(where, shard), manifest["shards"])
    for status, text in lines:
        print(f"{status:<12}  {text}")
    return 1 if any(status == MISMATCH for status, _ in lines) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m scalevec_train.verify <path>`: every checkpoint and every token shard under `path` (a
run directory, a folder of runs, one checkpoint, an averaged folder, data.cache_dir or one prepared
folder) checked against the checksums recorded when it was written, one line each (run/audit.py):

    ok            runs/x/checkpoints/step_000300  (6 files, 12.1 MB)
    MISMATCH      runs/x/checkpoints/step_000400/__0_0.distcp: does not match the
                  checksum recorded ...
    no checksums  runs/old/checkpoints/step_000100  (written before checksums were recorded)
    ok            data_cache/stdlib-1a2b3c/train/00000.bin

Exit code 0 when nothing mismatches, 1 when something does, 2 when `path` holds neither.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

from scalevec_train.run import cli
from scalevec_train.run.audit import MISMATCH, audit


@dataclass
class Options:
    path: Path = cli.positional("a run directory, data.cache_dir, or one checkpoint or "
                                "prepared folder")


def run(o: Options) -> int:
    lines = audit(o.path)
    for status, text in lines:
        print(f"{status:<12}  {text}")
    return 1 if any(status == MISMATCH for status, _ in lines) else 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Attempts of training runs, one after the other, in one torchrun launch: each attempt runs in children
forked from the workers, so that a test can kill a run and resume it many times without paying for
starting Python and importing torch again (some 3 s of CPU per rank and attempt).

    torchrun --nproc_per_node=2 tests/attempts.py <folder>

The driver (tests/launch.py, Attempts) writes <folder>/<i>.json, {"overrides": [...], "env": {...}}, for
attempt i = 0, 1, ..., and <folder>/done after the last. For each attempt every worker forks a child that
does what `python -m scalevec_train.train <overrides>` does under torchrun, with `env` added; the worker
writes the child's pid to <i>.rank<r>.pid and, once it has ended, its exit code to <i>.rank<r>.exit
(negative: the signal that ended it). The children of an attempt meet in a process group of their own
(process_group.init takes a fresh namespace in torchrun's store).
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

from scalevec_train import train


def write(path: Path, text: str) -> None:
    """All of `text` or no file: the driver polls for it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)


def attempt(spec: dict) -> int:
    """The child's work; returns its exit code."""
    os.environ.update(spec["env"])
    sys.argv = [sys.argv[0], *spec["overrides"]]
    try:
        train.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(folder: Path) -> None:
    rank = os.environ["RANK"]
    i = 0
    while not (folder / "done").exists():
        spec = folder / f"{i}.json"
        if not spec.exists():
            time.sleep(0.02)
            continue
        pid = os.fork()
        if pid == 0:
            code = attempt(json.loads(spec.read_text()))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # not the worker's remaining work, nor its exit handlers
        write(folder / f"{i}.rank{rank}.pid", str(pid))
        _, status = os.waitpid(pid, 0)
        write(folder / f"{i}.rank{rank}.exit", str(os.waitstatus_to_exitcode(status)))
        i += 1


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Attempts of training runs, one after the other, in one torchrun launch: each attempt runs in
children forked from the workers, so that a test can kill a run and resume it many times without
paying for starting Python and importing torch again (some 3 s of CPU per rank and attempt).

    torchrun --nproc_per_node=2 tests/support/attempts.py <folder>

The driver (tests/support/launch.py, Attempts) writes <folder>/<i>.json, {"overrides": [...], "env":
{...}}, for attempt i = 0, 1, ..., and <folder>/done after the last. For each attempt every worker
forks a child that does what `python -m scalevec_train.train <overrides>` does under torchrun, with
`env` added; the worker writes the child's pid to <i>.rank<r>.pid and, once it has ended, its exit
code to <i>.rank<r>.exit (negative: the signal that ended it). The children of an attempt meet in a
process group of their own (process_group.init takes a fresh namespace in torchrun's store).

A child's CPU goes mostly to what the worker has not done for it yet: the modules a run imports on
first use (torch's compiler configs, DCP, Hydra's parser: over a second), Hydra's composition of the
config, and the collections at the end of a run, which walk every object of the process. So each
child leaves the list of its modules, which the worker imports before the next fork; the worker
composes each list of overrides once (attempts that differ only in `env`, a run killed and resumed,
share it: Hydra's composition reads configs/ and the overrides, not the environment) and freezes its
objects out of the collector's reach.
"""

import gc
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig

from scalevec_train import train
from scalevec_train.config import compose_raw


def write(path: Path, text: str) -> None:
    """All of `text` or no file: the driver polls for it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)


def attempt(spec: dict, raw: DictConfig | None) -> int:
    """The child's work: scalevec_train.train's main on the config Hydra composed from the overrides
    (by the worker; here if it failed there, so that the error is the child's); returns its exit
    code."""
    os.environ.update(spec["env"])
    try:
        train.main.__wrapped__(compose_raw(spec["overrides"]) if raw is None else raw)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def composed(overrides: list[str],
             known: dict[tuple[str, ...], DictConfig | None]) -> DictConfig | None:
    """The config Hydra composes from `overrides`, once per list; None where composing fails."""
    key = tuple(overrides)
    if key not in known:
        try:
            known[key] = compose_raw(overrides)
        except Exception:
            known[key] = None
    return known[key]


def warm(modules: Path) -> None:
    """Import what the children imported; freeze every object, so that a child's collections skip
    them."""
    for name in modules.read_text().split() if modules.exists() else []:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # warming is optional: the child imports what it needs itself
                pass
    gc.freeze()


def main(folder: Path) -> None:
    rank = os.environ["RANK"]
    modules = folder / f"modules.rank{rank}"
    i, known = 0, {}
    while not (folder / "done").exists():
        spec = folder / f"{i}.json"
        if not spec.exists():
            time.sleep(0.02)
            continue
        todo = json.loads(spec.read_text())
        raw = composed(todo["overrides"], known)
        warm(modules)
        pid = os.fork()
        if pid == 0:
            code = attempt(todo, raw)
            write(modules, "\n".join(sorted(sys.modules)))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # not the worker's remaining work, nor its exit handlers
        write(folder / f"{i}.rank{rank}.pid", str(pid))
        _, status = os.waitpid(pid, 0)
        write(folder / f"{i}.rank{rank}.exit", str(os.waitstatus_to_exitcode(status)))
        i += 1


if __name__ == "__main__":
    main(Path(sys.argv[1]))

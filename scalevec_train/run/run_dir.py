"""The run directory of a training run: checked and locked before anything is built (lock.py; rank 0
holds the lock for the life of the run, and a second launch into it refuses on every rank before
anything is written), then made self-contained once the run is built: the resolved config, the model
description, the tokenizer, what a continuation changed (resumes.jsonl) and a branch's trunk
metrics."""

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scalevec_train.checkpoint.files import checkpoint_root
from scalevec_train.config import Config, to_yaml
from scalevec_train.costs.tables import describe
from scalevec_train.data import tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.lock import DirLock, Held, holder
from scalevec_train.parallel import process_group
from scalevec_train.run.branch import copy_trunk_metrics
from scalevec_train.run.build import Run
from scalevec_train.run.resume import record as record_continuation


def check_run_dir(run_dir: Path) -> None:
    """Fails, creating nothing, unless run_dir is or can become a writable folder."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = ("is a file" if existing == run_dir
                 else f"would be a folder under the file {existing}")
        raise ScalevecError("run_dir", f"{run_dir} {where}, so it cannot hold a run.",
                            "set run_dir to a folder path (an existing run or a new name).")
    root = checkpoint_root(run_dir)
    for folder in (existing, root) if root.is_dir() else (existing,):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ScalevecError("run_dir", f"{folder} is not writable.",
                                "fix its permissions, or set run_dir to a folder you can write to.")


@contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """The run directory checked, then locked by rank 0 until the block ends. A run directory that
    this launch made and left holding nothing (bad input found later) is removed again."""
    check_run_dir(run_dir)
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
    lock, held = None, None
    if process_group.is_main():
        lock = DirLock(run_dir)
        try:
            lock.acquire()
        except Held as e:
            lock, held = None, f"{holder(e.record)}; its lock {e.path}"
    held = process_group.broadcast_object(held)
    if held is not None:
        raise ScalevecError("run_dir", f"{run_dir} is in use by a live run ({held}): two runs in "
                            "one directory overwrite each other's checkpoints and records.",
                            "wait for that run to end or stop it (a run that was killed or lost "
                            "its node holds nothing: the next launch takes over), or set another "
                            "run_dir.")
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
            if made and [p.name for p in run_dir.iterdir()] == [lock.path.name]:
                lock.path.unlink()
                for d in made:  # the run directory, then the parents it was made with
                    try:
                        d.rmdir()
                    except OSError:  # not empty: another run's meanwhile
                        break


def write_run_files(cfg: Config, built: Run) -> None:
    """What makes the run directory self-contained and says where the run came from
    (rank 0 writes it)."""
    run_dir = built.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "describe.json").write_text(json.dumps(describe(cfg, built.attended), indent=1))
    tokenizer.install(built.data.tokenizer_path, run_dir)  # as tokenizer.model, or tokenizer.json
    if built.continued:
        record_continuation(run_dir, *built.continued)
    if built.branched_from is not None:
        copy_trunk_metrics(built.branched_from, run_dir)

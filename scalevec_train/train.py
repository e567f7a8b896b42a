"""Training entry point: `python -m scalevec_train.train [hydra overrides]` (or under torchrun).

config -> build (data + model + optimizer + trainer and callbacks) -> fit -> metrics and checkpoints.
What survives crashes, signals and bad numbers, and how failures are reported: docs/reliability.md.
"""

import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from scalevec_train.config import CONFIG_DIR, Config, to_config, to_yaml
from scalevec_train.costs.accounting import total_params
from scalevec_train.costs.tables import describe
from scalevec_train.data import tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.lock import DirLock, Held, holder
from scalevec_train.optim.groups import describe_groups
from scalevec_train.parallel import process_group
from scalevec_train.run.branch import copy_trunk_metrics
from scalevec_train.run.build import build, check_run_dir
from scalevec_train.run.resume import record as record_continuation
from scalevec_train.training.logger import MetricsLogger, wandb_init_args


def write_run_files(cfg: Config, run_dir: Path, tokenizer_path: Path, attended: float | None = None) -> None:
    """The resolved config, the model description and the tokenizer: a run directory is self-contained.
    attended: see describe()."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "describe.json").write_text(json.dumps(describe(cfg, attended), indent=1))
    tokenizer.install(tokenizer_path, run_dir)  # as tokenizer.model, or tokenizer.json


@contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """The run directory's lock (lock.py), held by rank 0 for the life of the run: a second launch into it
    refuses on every rank before anything is written. A run directory that this launch made and left
    holding nothing (bad input found later) is removed again."""
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
        raise ScalevecError("run_dir", f"{run_dir} is in use by a live run ({held}): two runs in one directory "
                            "overwrite each other's checkpoints and records.", "wait for that run to end or stop "
                            "it (a run that was killed or lost its node holds nothing: the next launch takes "
                            "over), or set another run_dir.")
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


def run(cfg: Config) -> Path:
    """Train to cfg.train.steps, or until an early stop: SIGTERM returns with a complete checkpoint,
    train.max_bad_steps non-finite steps in a row raise DivergedError (from the stability guard, once
    the checkpoint is complete). Returns the run directory. The run directory is locked meanwhile."""
    with holding(Path(process_group.broadcast_object(cfg.run_dir))):
        return _run(cfg)


def _run(cfg: Config) -> Path:
    built = build(cfg)
    trainer, run_dir = built.trainer, built.run_dir
    main = process_group.is_main()
    wandb_init = None
    if main:
        write_run_files(cfg, run_dir, built.data.tokenizer_path, built.attended)
        if built.continued:
            record_continuation(run_dir, *built.continued)
        if built.branched_from is not None:
            copy_trunk_metrics(built.branched_from, run_dir)
        print(f"run_dir: {run_dir}  params: {total_params(trainer.model):,}  "
              f"optimizer: {describe_groups(trainer.optimizer)}", file=sys.stderr)
        if cfg.logger.name == "wandb":
            wandb_init = wandb_init_args(cfg.logger, OmegaConf.to_container(OmegaConf.structured(cfg)), run_dir)
    logger = MetricsLogger(cfg.logger, run_dir, cfg.train.steps, trainer.step, wandb_init, enabled=main)
    try:
        stopped = trainer.fit(logger)
    finally:
        logger.close()
    path = built.checkpointer.last_path
    if stopped and main:
        print(f"stopped by {stopped} after step {trainer.step}: checkpoint {path} is complete. Continue "
              "with resume=auto.", file=sys.stderr)
    return run_dir


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def main(raw: DictConfig) -> None:
    """Exit codes: 0 done, or stopped by SIGTERM with a checkpoint; 1 a bug (with its traceback) or a
    Hydra error; 2 bad input (one line naming the key or file and the fix); 3 diverged (see run()); 4 a
    checkpoint that could not be written; 5 a hang (training/callbacks/watchdog.py)."""
    finished, exit_code = False, 0
    try:
        # Checked before joining the process group: a bad config fails at once, on every rank.
        cfg = to_config(raw, process_group.world_size())
        process_group.init(cfg.distributed.init_timeout_s)
        run(cfg)
        finished = True
    except ScalevecError as e:
        rank = f"[rank {os.environ.get('RANK', 0)}] " if process_group.world_size() > 1 else ""
        # One write: the ranks share a log, and print writes a line and its end apart on an unbuffered
        # stream (PYTHONUNBUFFERED), where another rank's line can land between them.
        sys.stderr.write(f"{rank}error: {e}\n")
        exit_code = e.exit_code
    finally:
        # The run's frames in a traceback would keep its model, and through FSDP the process group,
        # alive past shutdown (which must free the group: see there); clear_frames keeps what is printed.
        if (handled := sys.exc_info()[1]) is not None:
            traceback.clear_frames(handled.__traceback__)
        process_group.shutdown(finished)
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()

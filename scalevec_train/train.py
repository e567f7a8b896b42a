"""Training entry point: `python -m scalevec_train.train [hydra overrides]` (or under torchrun).

config -> run directory checked and locked (run/run_dir.py) -> build (run/build.py: data, model,
optimizer, checkpoint manager, callbacks, trainer) -> the run's files -> fit -> metrics and
checkpoints. What survives crashes, signals and bad numbers, and how failures are reported:
docs/guides/reliability.md.
"""

import os
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from scalevec_train.config import CONFIG_DIR, Config, check_overrides, to_config
from scalevec_train.costs.accounting import total_params
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.optim.groups import describe_groups
from scalevec_train.parallel import process_group
from scalevec_train.run.build import build
from scalevec_train.run.run_dir import holding, write_run_files
from scalevec_train.training.logger import MetricsLogger, wandb_init_args


def run(cfg: Config) -> Path:
    """Train to cfg.train.steps, or until an early stop: SIGTERM returns with a complete checkpoint,
    train.max_bad_steps non-finite steps in a row raise DivergedError (from the stability guard,
    once the checkpoint is complete). Returns the run directory. The run directory is locked
    meanwhile."""
    with holding(Path(process_group.broadcast_object(cfg.run_dir))):
        built = build(cfg)
        trainer, run_dir, main = built.trainer, built.run_dir, process_group.is_main()
        wandb_init = None
        if main:
            write_run_files(cfg, built)
            print(f"run_dir: {run_dir}  params: {total_params(trainer.model):,}  "
                  f"optimizer: {describe_groups(trainer.optimizer)}", file=sys.stderr)
            if cfg.logger.name == "wandb":
                wandb_init = wandb_init_args(
                    cfg.logger, OmegaConf.to_container(OmegaConf.structured(cfg)), run_dir)
        logger = MetricsLogger(cfg.logger, run_dir, cfg.train.steps, trainer.step, wandb_init,
                               enabled=main)
        try:
            stopped = trainer.fit(logger)
        finally:
            logger.close()
        if stopped and main:
            print(f"stopped by {stopped} after step {trainer.step}: checkpoint "
                  f"{built.checkpointer.last_path} is complete. Continue with resume=auto.",
                  file=sys.stderr)
        return run_dir


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def main(raw: DictConfig) -> None:
    """Exit codes: 0 done, or stopped by SIGTERM with a checkpoint; 1 a bug (with its traceback) or
    a Hydra error; 2 bad input (one line naming the key or file and the fix); 3 diverged
    (see run()); 4 a checkpoint that could not be written; 5 a hang
    (training/callbacks/watchdog.py)."""
    finished, exit_code = False, 0
    try:
        # Checked before joining the process group: a bad config fails at once, on every rank.
        # the command line's own overrides (not set for a caller's config)
        if HydraConfig.initialized():
            check_overrides(raw, list(HydraConfig.get().overrides.task))
        cfg = to_config(raw, process_group.world_size())
        process_group.init(cfg.distributed.init_timeout_s)
        run(cfg)
        finished = True
    except ScalevecError as e:
        rank = f"[rank {os.environ.get('RANK', 0)}] " if process_group.world_size() > 1 else ""
        # One write: the ranks share a log, and print writes a line and its end apart on an
        # unbuffered stream (PYTHONUNBUFFERED), where another rank's line can land between them.
        sys.stderr.write(f"{rank}error: {e}\n")
        exit_code = e.exit_code
    finally:
        # The run's frames in a traceback would keep its model, and through FSDP the process group,
        # alive past shutdown (which must free the group: see there); clear_frames keeps what is
        # printed.
        if (handled := sys.exc_info()[1]) is not None:
            traceback.clear_frames(handled.__traceback__)
        process_group.shutdown(finished)
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()

"""Where a run starts: fresh (or from init_from's weights), from the newest complete checkpoint of
its own run directory (resume), or from a trunk's checkpoint (branch_from: branch.py). Everything
here is checked before any data is prepared or weight initialized: the checkpoint's files against
their checksums, its config against this run's (resume.py), its model and optimizer against this
run's."""

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from scalevec_train.checkpoint import integrity
from scalevec_train.checkpoint.files import check_model_fits, find_resume, inspect
from scalevec_train.config import Config
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.config import architecture_diff
from scalevec_train.parallel.process_group import broadcast_object
from scalevec_train.run.branch import branch_point, check_own_run_dir
from scalevec_train.run.resume import check_continuation, saved_config


@dataclass
class Start:
    run_dir: Path
    # the checkpoint the run continues (its own, or its trunk's); None: a fresh run
    checkpoint: Path | None
    branched_from: Path | None  # the trunk's checkpoint when this run starts a branch
    train_state: dict | None  # the checkpoint's train_state.json

    def check(self, cfg: Config, model: torch.nn.Module) -> dict[str, dict] | None:
        """The config's changes from the checkpoint's run (None for a fresh run), after refusing a
        checkpoint of another model or optimizer (`model` may be on the meta device)."""
        if self.train_state is None:
            return None
        continued = check_continuation_of(cfg, self.checkpoint, self.train_state,
                                          self.branched_from is not None)
        check_resumable(cfg, self.checkpoint, self.train_state, model)
        return continued


def find_start(cfg: Config) -> Start:
    """Every rank uses rank 0's run_dir and checkpoint choice."""
    run_dir = Path(broadcast_object(cfg.run_dir))
    if cfg.branch_from:
        check_own_run_dir(Path(cfg.branch_from), run_dir)
    resume_from = broadcast_object(find_resume(run_dir, cfg.resume))
    # A branch that has checkpoints of its own continues from them (resume=auto) like any run.
    branched_from = (broadcast_object(branch_point(cfg, run_dir))
                     if cfg.branch_from and not resume_from else None)
    resume_from = resume_from or branched_from
    if resume_from and cfg.checkpoint.verify:
        key = "branch_from" if branched_from else "resume"
        integrity.verify(resume_from, lambda good: f"{key}={good}", "checkpoint.verify=false")
    return Start(run_dir, resume_from, branched_from, inspect(resume_from) if resume_from else None)


def check_continuation_of(cfg: Config, path: Path, train_state: dict,
                          branch: bool) -> dict[str, dict]:
    """The config's changes from the run that wrote checkpoint `path` (resume.py), refused where one
    defines the trajectory; {} when that run's config is unknown (a checkpoint copied alone, written
    before checkpoints held their config), which is said."""
    saved = saved_config(train_state, path)
    if saved is None:
        print(f"note: the config that wrote {path} is unknown (no config.yaml beside it): "
              "continuing without comparing it with this one.", file=sys.stderr)
        return {}
    return check_continuation(saved, cfg, train_state["step"], path,
                              "branch_from" if branch else "resume", length_checked=branch)


def check_resumable(cfg: Config, path: Path, train_state: dict, model: torch.nn.Module) -> None:
    """Raises unless checkpoint `path` was written for this model and optimizer (`model` may be on
    the meta device): before any data is prepared or weight initialized."""
    diff = architecture_diff(train_state["model_config"], cfg.model.architecture())
    if diff:
        raise ScalevecError(str(path), f"was written by another model (differs in {diff}).",
                            "resume with the model config of that run, or use another run_dir.")
    saved_optim = train_state.get("optimizer", cfg.optim.name)  # absent in older checkpoints
    if saved_optim != cfg.optim.name:
        raise ScalevecError(str(path), f"holds the state of optimizer {saved_optim!r}; this run "
                            f"uses optim={cfg.optim.name}.",
                            f"resume with optim={saved_optim}, or use another run_dir.")
    check_model_fits(path, model)

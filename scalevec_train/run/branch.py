"""WSD cooldown branches (`branch_from=<run dir or checkpoint>`): a run that starts from a
checkpoint of another run, its trunk, with the trunk's weights, optimizer state and data position,
in its own run_dir, and decays to its own train.steps. One stable WSD run thus gives the losses of
several budgets.

A branch is the trunk's computation up to the branch point, so it must have followed the same
learning rate at every step before it (same peak LR and warm-up, and a decay that has not started
yet) with the same tokens per step; the data, seed and model are checked as for any resume. Given a
run directory, the branch starts from the newest complete checkpoint that qualifies; given a
checkpoint, from that one.

Its record: config.yaml keeps branch_from as given, and metrics.jsonl starts with the trunk's
records up to the branch point (what a resumed copy of the trunk would hold), then one naming the
checkpoint, so that the branch's curves and terminal loss read like those of a run trained from
scratch to its length.
"""

import json
from pathlib import Path

from scalevec_train.checkpoint.files import (
    COMPLETE,
    checkpoint_root,
    checkpoint_step,
    complete_checkpoints,
)
from scalevec_train.config import Config, read_run_config
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.optim.schedules import lr_multiplier
from scalevec_train.training.logger import read_records


def trunk_dir(checkpoint: Path) -> Path:
    return checkpoint.parent.parent


def peak_lrs(cfg: Config, step: int) -> tuple[float, float, float]:
    """The learning rates of step `step` (0-based): the hidden matrices', the other AdamW groups'
    (adamw_lr under Muon) and the scale sites' (scale_lr)."""
    multiplier = lr_multiplier(cfg.schedule, step, cfg.train.steps)
    return tuple(lr * multiplier
                 for lr in (cfg.optim.lr, cfg.optim.adamw_peak_lr(), cfg.optim.scale_peak_lr()))


def shared_steps(trunk: Config, branch: Config, limit: int) -> int:
    """How many first steps (at most `limit`) the two runs take at the same learning rates."""
    for step in range(limit):
        if peak_lrs(trunk, step) != peak_lrs(branch, step):
            return step
    return limit


def candidates(source: Path) -> list[Path]:
    """The checkpoints `source` offers, oldest first: itself, or a run directory's complete ones."""
    if not source.is_dir():
        raise ScalevecError("branch_from", f"{source} does not exist or is not a folder.",
                            "point branch_from at a run directory or one of its "
                            "checkpoints/step_* folders.")
    if checkpoint_root(source).is_dir():
        found = complete_checkpoints(source)
        if not found:
            raise ScalevecError("branch_from", f"{source} holds no complete checkpoint.",
                                "train the trunk with checkpoint.every=N so that it saves some in "
                                "its stable phase.")
        return found
    if not (source / COMPLETE).is_file() or not source.name.startswith("step_"):
        raise ScalevecError("branch_from",
                            f"{source} is neither a run directory nor a complete checkpoint.",
                            "point branch_from at a run directory or one of its "
                            "checkpoints/step_* folders.")
    return [source]


def check_own_run_dir(source: Path, run_dir: Path) -> None:
    """Raises when run_dir is the trunk's: a branch never writes into (or continues) its trunk."""
    trunk_run = source if checkpoint_root(source).is_dir() else trunk_dir(source)
    if trunk_run.resolve() == run_dir.resolve():
        raise ScalevecError("run_dir", f"{run_dir} is the trunk's own run directory.",
                            "give the branch a run_dir of its own, "
                            "e.g. with its length in the name.")


def branch_point(cfg: Config, run_dir: Path) -> Path:
    """The checkpoint this branch starts from (see the module docstring), after the checks that do
    not need the checkpoint's tensors."""
    found = candidates(Path(cfg.branch_from))
    trunk_run = trunk_dir(found[0])
    trunk = read_run_config(trunk_run)
    tokens, trunk_tokens = (cfg.train.global_batch * cfg.train.seq_len,
                            trunk.train.global_batch * trunk.train.seq_len)
    if tokens != trunk_tokens:
        raise ScalevecError("train.global_batch", f"this branch takes {tokens:,} tokens per step, "
                            f"its trunk {trunk_run} took {trunk_tokens:,}.",
                            "branch with the trunk's train.global_batch and train.seq_len.")
    shared = shared_steps(trunk, cfg, checkpoint_step(found[-1]))
    usable = [p for p in found
              if checkpoint_step(p) <= shared and checkpoint_step(p) < cfg.train.steps]
    if not usable:
        steps = ", ".join(str(checkpoint_step(p)) for p in found)
        raise ScalevecError("branch_from", f"no checkpoint of {trunk_run} (steps {steps}) is at or "
                            f"before step {min(shared, cfg.train.steps - 1)}: after it this branch "
                            "ends or its learning rates leave the trunk's (its decay, or another "
                            "peak LR, warm-up or schedule).",
                            "branch from a checkpoint of the trunk's stable phase (the trunk's "
                            "checkpoint.every and checkpoint.keep_last decide which exist), or "
                            "give the branch a later end.")
    return usable[-1]


def copy_trunk_metrics(checkpoint: Path, run_dir: Path) -> None:
    """Start run_dir/metrics.jsonl with the trunk's records up to the checkpoint's step and a record
    naming the checkpoint."""
    step = checkpoint_step(checkpoint)
    kept = [r for r in read_records(trunk_dir(checkpoint) / "metrics.jsonl") if r["step"] <= step]
    kept.append({"step": step, "branch_from": str(checkpoint)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))

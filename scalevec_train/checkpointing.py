"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resharding on load, never half-written.

Layout: run_dir/checkpoints/step_000050/ holds
    the DCP shards and metadata of model and optimizer  (each rank writes its own shards)
    train_state.json   step, world size, the data loader's global sample position, the model config
    rng_rank<r>.pt     rank r's RNG states
    COMPLETE           the marker of a whole checkpoint
A save is written into a temporary directory (.tmp_step_000050_<id>). Once every rank has finished
writing, rank 0 adds train_state.json and COMPLETE and renames the directory to step_000050 (one atomic
rename), then deletes checkpoints beyond the newest `keep_last` and leftovers of interrupted saves. An
interrupted save therefore never replaces the last good checkpoint, and `resume=auto` only ever picks
complete ones.

Asynchronous saves (checkpoint.async_save) stage a CPU copy of the state and write it in a background
thread, which talks over its own gloo process group so that its collectives never interleave with the
training's. The rename happens at the next sync point: the next save, or finish() at the end of a run.

Resuming on another world size: DCP reshards model and optimizer, and the loader position counts
global samples, so both continue exactly. RNG states are per rank and are restored only on the same
world size (training draws no random numbers today, so losses do not depend on them).
"""

import json
import shutil
import sys
import uuid
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from scalevec_train import distributed
from scalevec_train.errors import ScalevecError

COMPLETE = "COMPLETE"
STATE_FILE = "train_state.json"
TMP_PREFIX = ".tmp_step_"

# One process without a process group is our normal single-device mode, not a mistake to warn about.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


@dataclass
class _Save:
    """A save whose shards are (being) written but which is not renamed into place yet."""

    future: Future | None  # the async write; None once written
    tmp: Path
    final: Path
    train_state: dict
    keep_last: int


_pending: _Save | None = None
_async_group = None


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict, keep_last: int, async_save: bool = False) -> Path:
    """Save a checkpoint of `step`; every rank calls it. Returns the final path (complete on return
    unless async_save: then after the next save() or finish())."""
    global _pending
    finish()
    final = step_dir(run_dir, step)
    tmp = final.parent / distributed.broadcast_object(f"{TMP_PREFIX}{step:06d}_{uuid.uuid4().hex[:8]}")
    if distributed.is_main():
        tmp.mkdir(parents=True)
    distributed.barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{distributed.rank()}.pt")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    info = {"step": step, "world_size": distributed.world_size(), **train_state}
    if async_save:
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=_checkpoint_group())
        _pending = _Save(future, tmp, final, info, keep_last)
    else:
        dcp.save(state, checkpoint_id=str(tmp))
        _pending = _Save(None, tmp, final, info, keep_last)
        finish()
    return final


def finish() -> Path | None:
    """Complete the pending save, if any: wait for its writes on every rank, then rank 0 marks it
    complete and renames it into place. Returns its final path."""
    global _pending
    if _pending is None:
        return None
    done, _pending = _pending, None
    if done.future is not None:
        done.future.result()
    distributed.barrier()  # every rank's shards are on disk
    if distributed.is_main():
        (done.tmp / STATE_FILE).write_text(json.dumps(done.train_state, indent=1))
        (done.tmp / COMPLETE).write_text("")
        if done.final.exists():
            shutil.rmtree(done.final)
        done.tmp.rename(done.final)
        _retain(done.final.parent, done.keep_last)
    distributed.barrier()
    return done.final


def _checkpoint_group():
    """A gloo group for async saves; created on first use (by every rank, at the same save)."""
    global _async_group
    if dist.is_initialized() and _async_group is None:
        _async_group = dist.new_group(backend="gloo")
    return _async_group


def _retain(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest keep_last, and leftovers of interrupted saves."""
    for old in complete_checkpoints(root.parent)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from: None (fresh), the newest complete one (auto), or a path."""
    if resume == "none":
        if complete_checkpoints(run_dir):
            raise ScalevecError("resume", f"{run_dir} already holds checkpoints and resume=none would "
                                "train over them.", "pass resume=auto to continue that run, or pick "
                                "another run_dir.")
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise ScalevecError("resume", f"{path} is not a complete checkpoint (no {COMPLETE} marker).",
                            "point resume at a checkpoints/step_* directory of a finished save, or use "
                            "resume=auto.")
    return path


def read_train_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ScalevecError(str(path / STATE_FILE), f"cannot be read ({e}).",
                            "the checkpoint is damaged: resume from an older one.") from None


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer state in place, resharding to the current world size; restore the RNG
    states when the world size is the one the checkpoint was written with."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP raises several types for missing keys and shape mismatches
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ScalevecError(str(path), f"does not fit this model/optimizer ({first}).",
                            "resume with the config the checkpoint was written with.") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    saved_world = read_train_state(path).get("world_size", 1)
    if saved_world == distributed.world_size():
        _set_rng_state(torch.load(path / f"rng_rank{distributed.rank()}.pt", weights_only=True))
    elif distributed.is_main():
        print(f"resume: {path} was written by {saved_world} ranks, this run has "
              f"{distributed.world_size()}: model, optimizer and data position reshard; the per-rank RNG "
              "states are not restored.", file=sys.stderr)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resharding on load, never half-written.

Layout: run_dir/checkpoints/step_000050/ holds the DCP shards of model and optimizer, train_state.json
(step, loader position, the model config) and rng_rank<r>.pt. A save is written into a temporary
directory and renamed only when every rank has finished; the COMPLETE marker is written last. So an
interrupted save never replaces the last good checkpoint, and `resume=auto` only ever sees complete
ones.
"""

import json
import shutil
import uuid
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

from scalevec_train.errors import ScalevecError

COMPLETE = "COMPLETE"
STATE_FILE = "train_state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str) -> str:
    """All ranks agree on rank 0's value (e.g. a temporary directory name)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict, keep_last: int) -> Path:
    """Save a checkpoint of `step` on every rank; returns its final path."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / _broadcast_str(f".tmp_step_{step:06d}_{uuid.uuid4().hex[:8]}")
    if _rank() == 0:
        tmp.mkdir(parents=True)
    _barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **train_state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        (final / COMPLETE).write_text("")
        _retain(root, keep_last)
    _barrier()
    return final


def _retain(root: Path, keep_last: int) -> None:
    """Delete complete checkpoints beyond the newest keep_last, and leftovers of interrupted saves."""
    for old in complete_checkpoints(root.parent)[:-keep_last]:
        shutil.rmtree(old)
    for leftover in root.glob(".tmp_step_*"):
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
    """Load model and optimizer state in place, resharding to the current world size."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # DCP raises several types for missing keys and shape mismatches
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ScalevecError(str(path), f"does not fit this model/optimizer ({first}).",
                            "resume with the config the checkpoint was written with.") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resharding on load, never half-written.

Layout: run_dir/checkpoints/step_000050/ holds
    the DCP shards and metadata of model and optimizer  (each rank writes its own shards)
    train_state.json   step, world size, the data loader's global sample position, the model config,
                       the optimizer's name and the trainer's numerical-guard counters
    rng_rank<r>.pt     rank r's RNG states
    COMPLETE           the marker of a whole checkpoint
A save is written into a temporary directory (.tmp_step_000050_<id>). Once every rank has finished
writing, rank 0 adds train_state.json and COMPLETE and renames the directory to step_000050 (one atomic
rename), then deletes checkpoints beyond the newest `keep_last` and leftovers of interrupted saves. An
interrupted save therefore never replaces the last good checkpoint, and `resume=auto` only ever picks
complete ones. Deleting removes the COMPLETE marker first, and a checkpoint that is written again (a
resumed run reaching the same step) is first renamed away as a leftover, so that a process killed at
any moment never leaves a marked directory with missing files.

Before a resume reads any tensor, inspect() checks that the train state is readable, that every file
the DCP metadata names exists and is long enough, and check_model_fits() that the saved tensors have
the names and shapes of the model being built: a damaged checkpoint or one of another model fails
before data preparation and model initialization, naming the file.

Asynchronous saves (checkpoint.async_save) stage a CPU copy of the state and write it in a background
thread, which talks over its own gloo process group so that its collectives never interleave with the
training's. The rename happens at the next sync point: the next save, or finish() at the end of a run.

Resuming on another world size: DCP reshards model and optimizer, and the loader position counts
global samples, so both continue exactly. RNG states are per rank and are restored only on the same
world size (training draws no random numbers today, so losses do not depend on them).
"""

import io
import json
import pathlib
import pickle
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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
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
METADATA_FILE = ".metadata"  # DCP's name for it

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
        if done.final.exists():  # the same step saved before: it becomes a leftover, deleted below
            done.final.rename(done.final.parent / f"{TMP_PREFIX}{done.final.name}_{uuid.uuid4().hex[:8]}")
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
        (old / COMPLETE).unlink()  # first: a deletion cut short leaves no checkpoint that looks whole
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
    if not path.is_dir():
        raise ScalevecError("resume", f"{path} does not exist or is not a folder.",
                            "point resume at a checkpoints/step_* folder, or use resume=auto or none.")
    if checkpoint_root(path).is_dir():
        raise ScalevecError("resume", f"{path} is a run directory, not a checkpoint.",
                            f"pass run_dir={path} resume=auto to continue it, or point resume at one of "
                            "its checkpoints/step_* folders.")
    if not (path / COMPLETE).is_file():
        raise ScalevecError("resume", f"{path} is not a complete checkpoint (no {COMPLETE} marker).",
                            "point resume at a checkpoints/step_* directory of a finished save, or use "
                            "resume=auto.")
    return path


_DAMAGED = ("the checkpoint is damaged: use an older one (resume=<its checkpoints/step_* path>, or "
            "scalevec_train.load(<that path>)).")


def read_train_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ScalevecError(str(path / STATE_FILE), f"cannot be read ({e}).", _DAMAGED) from None


def inspect(path: Path) -> dict:
    """The train state of checkpoint `path` after checking, without reading any tensor, that it is
    well-formed and that every file it needs is there and long enough."""
    state = read_train_state(path)
    where = str(path / STATE_FILE)
    if not isinstance(state, dict):
        raise ScalevecError(where, "is not a JSON object.", _DAMAGED)
    for key, kind in (("step", int), ("world_size", int), ("loader", dict), ("model_config", dict)):
        if not isinstance(state.get(key), kind):
            raise ScalevecError(where, f"has no valid {key!r} entry.", _DAMAGED)
    if state["step"] < 0 or state["world_size"] < 1:
        raise ScalevecError(where, f"has step={state['step']} and world_size={state['world_size']}.", _DAMAGED)
    sizes: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, need in sorted(sizes.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < need:
            problem = "is missing" if have is None else f"is truncated: {have} bytes, the metadata needs {need}"
            raise ScalevecError(str(file), f"{problem}.", _DAMAGED)
    for r in range(state["world_size"]):
        if not (path / f"rng_rank{r}.pt").is_file():
            raise ScalevecError(str(path / f"rng_rank{r}.pt"), "is missing.", _DAMAGED)
    return state


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what a DCP .metadata pickle holds (checkpoint metadata records, sizes, dtypes, paths),
    so that a crafted checkpoint cannot run code when it is inspected, resumed or loaded."""

    def find_class(self, module: str, name: str):
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath",
                                                 "PureWindowsPath"))
            or (module == "collections" and name == "OrderedDict"))
        if not allowed:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        if module == "pathlib":
            return getattr(pathlib, name)
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by _MetadataUnpickler (the base class reads the tensors
    with torch.load(weights_only=True))."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint `path`: which tensors it holds, their shapes and their files."""
    file = path / METADATA_FILE
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except FileNotFoundError:
        raise ScalevecError(str(file), "is missing: this is not a whole checkpoint.", _DAMAGED) from None
    except Exception as e:  # damaged pickle bytes show as any of several exception types
        raise ScalevecError(str(file), f"cannot be read ({type(e).__name__}: {e}).", _DAMAGED) from None
    if not isinstance(metadata, Metadata):
        raise ScalevecError(str(file), f"holds a {type(metadata).__name__}, not checkpoint metadata.", _DAMAGED)
    return metadata


def first_failure(e: BaseException) -> str:
    """The first underlying error of a DCP failure, in one line."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def check_model_fits(path: Path, model: torch.nn.Module) -> None:
    """Raises unless checkpoint `path` holds exactly the tensors of `model`'s state (names and shapes;
    a meta-device model will do)."""
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in read_metadata(path).state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"{k} has shape {list(saved[k])}, this model {list(wanted[k])}"
                for k in sorted(saved.keys() & wanted.keys()) if saved[k] != wanted[k]]
    missing, extra = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
    if missing:
        problems.append(f"it lacks {len(missing)} tensor(s) such as {missing[0]}")
    if extra:
        problems.append(f"it has {len(extra)} tensor(s) this model does not, such as {extra[0]}")
    if problems:
        raise ScalevecError(str(path), f"does not fit this model: {'; '.join(problems[:3])}.",
                            "resume with the model and scale config of the run that wrote it, or start "
                            "a new run_dir.")


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         saved_world: int | None = None) -> None:
    """Load model and optimizer state in place, resharding to the current world size; restore the RNG
    states when the world size is the one the checkpoint was written with (`saved_world`, read from its
    train state when not given)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)))
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise ScalevecError(str(path), f"cannot be loaded into this model/optimizer ({first_failure(e)}).",
                            "resume with the config the checkpoint was written with; if it is damaged, "
                            "resume from an older one.") from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    if saved_world is None:
        saved_world = read_train_state(path).get("world_size", 1)
    if saved_world == distributed.world_size():
        rng_file = path / f"rng_rank{distributed.rank()}.pt"
        try:
            rng = torch.load(rng_file, weights_only=True)
        except Exception as e:  # a damaged file shows as any of several exception types
            raise ScalevecError(str(rng_file), f"cannot be read ({type(e).__name__}).", _DAMAGED) from None
        _set_rng_state(rng)
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

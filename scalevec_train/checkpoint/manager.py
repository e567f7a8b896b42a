"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resharding on load, never half-written.

A CheckpointManager saves and loads a dict of stateful objects (anything with state_dict() and
load_state_dict()): those that hold tensors (model, optimizer) through DCP, each rank writing its own
shards; those that hold plain data (the data loader's position, the Stateful callbacks such as the
numerical guard) into train_state.json, readable before any tensor is (files.py has the layout and the
checks).

A save is written into a temporary directory (.tmp_step_000050_<id>). Once every rank has finished
writing, rank 0 adds train_state.json and COMPLETE and renames the directory to step_000050 (one atomic
rename), then deletes checkpoints beyond the newest `keep_last` and leftovers of interrupted saves. An
interrupted save therefore never replaces the last good checkpoint, and `resume=auto` only ever picks
complete ones. Deleting removes the COMPLETE marker first, and a checkpoint that is written again (a
resumed run reaching the same step) is first renamed away as a leftover, so that a process killed at
any moment never leaves a marked directory with missing files.

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
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from scalevec_train.checkpoint.files import (
    COMPLETE,
    DAMAGED,
    STATE_FILE,
    TMP_PREFIX,
    SafeReader,
    check_files,
    check_model_fits,
    complete_checkpoints,
    first_failure,
    read_metadata,
    step_dir,
)
from scalevec_train.errors import ScalevecError
from scalevec_train.model.protocol import TrainableModel
from scalevec_train.parallel.process_group import barrier, broadcast_object, is_main, rank, world_size


class ModelState(Stateful):
    """A model's parameters and buffers as DCP sees them (sharded under FSDP)."""

    def __init__(self, model: TrainableModel):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState(Stateful):
    """An optimizer's state, keyed by parameter names (so that it reshards with the model). Loading keeps
    the optimizer's own hyperparameters (peak LRs, decays, betas, ...): the resumed run's config sets
    them, as a fresh run's does (torch would restore the saved groups' values instead)."""

    def __init__(self, model: TrainableModel, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, values in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(values)


@dataclass
class _Save:
    """A save whose shards are (being) written but which is not renamed into place yet."""

    future: Future | None  # the async write; None once written
    tmp: Path
    final: Path
    train_state: dict


class CheckpointManager:
    """Saves `tensors` (DCP) and `records` (train_state.json) of a run to run_dir/checkpoints/step_*;
    loads them back. `info` is written into every train_state.json as it is (e.g. the model config).
    `optional`: the names of tensor states a checkpoint may lack (an option turned on at a resume, such
    as the weight EMA); they keep their fresh state where it does."""

    def __init__(self, run_dir: Path, tensors: dict[str, Stateful], records: dict[str, Stateful],
                 info: dict, keep_last: int, async_save: bool = False, optional: frozenset[str] = frozenset()):
        self.run_dir, self.tensors, self.records, self.info = run_dir, tensors, records, info
        self.keep_last, self.async_save, self.optional = keep_last, async_save, optional
        self.pending: _Save | None = None
        self.async_group = None

    def save(self, step: int) -> Path:
        """Save a checkpoint of `step`; every rank calls it. Returns the final path (complete on return
        unless async_save: then after the next save() or finish())."""
        self.finish()
        final = step_dir(self.run_dir, step)
        tmp = final.parent / broadcast_object(f"{TMP_PREFIX}{step:06d}_{uuid.uuid4().hex[:8]}")
        if is_main():
            tmp.mkdir(parents=True)
        barrier()
        torch.save(_rng_state(), tmp / f"rng_rank{rank()}.pt")
        train_state = {"step": step, "world_size": world_size(),
                       **{name: obj.state_dict() for name, obj in self.records.items()}, **self.info}
        if self.async_save:
            future = dcp.async_save(self.tensors, checkpoint_id=str(tmp), process_group=self._async_group())
            self.pending = _Save(future, tmp, final, train_state)
        else:
            dcp.save(self.tensors, checkpoint_id=str(tmp))
            self.pending = _Save(None, tmp, final, train_state)
            self.finish()
        return final

    def finish(self) -> Path | None:
        """Complete the pending save, if any: wait for its writes on every rank, then rank 0 marks it
        complete and renames it into place. Returns its final path."""
        if self.pending is None:
            return None
        done, self.pending = self.pending, None
        if done.future is not None:
            done.future.result()
        barrier()  # every rank's shards are on disk
        if is_main():
            (done.tmp / STATE_FILE).write_text(json.dumps(done.train_state, indent=1))
            (done.tmp / COMPLETE).write_text("")
            if done.final.exists():  # the same step saved before: it becomes a leftover, deleted below
                done.final.rename(done.final.parent / f"{TMP_PREFIX}{done.final.name}_{uuid.uuid4().hex[:8]}")
            done.tmp.rename(done.final)
            self._retain(done.final.parent)
        barrier()
        return done.final

    def load(self, path: Path, train_state: dict) -> None:
        """Restore every state from checkpoint `path` (whose train state, already read, is
        `train_state`), resharding to the current world size; the RNG states only when the world size
        is the one the checkpoint was written with."""
        saved = {fqn.split(".", 1)[0] for fqn in read_metadata(path).state_dict_metadata}
        tensors = {k: v for k, v in self.tensors.items() if k in saved or k not in self.optional}
        try:
            dcp.load(tensors, storage_reader=SafeReader(str(path)))
        except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
            raise ScalevecError(str(path), f"cannot be loaded into this model/optimizer ({first_failure(e)}).",
                                "resume with the config the checkpoint was written with; if it is damaged, "
                                "resume from an older one.") from None
        for name, obj in self.records.items():
            if name in train_state:  # older checkpoints lack some records: they keep their fresh state
                obj.load_state_dict(train_state[name])
        saved_world = train_state.get("world_size", 1)
        if saved_world == world_size():
            rng_file = path / f"rng_rank{rank()}.pt"
            try:
                rng = torch.load(rng_file, weights_only=True)
            except Exception as e:  # a damaged file shows as any of several exception types
                raise ScalevecError(str(rng_file), f"cannot be read ({type(e).__name__}).", DAMAGED) from None
            _set_rng_state(rng)
        elif is_main():
            print(f"resume: {path} was written by {saved_world} ranks, this run has {world_size()}: model, "
                  "optimizer and data position reshard; the per-rank RNG states are not restored.",
                  file=sys.stderr)

    def _async_group(self):
        """A gloo group for async saves; created on first use (by every rank, at the same save)."""
        if dist.is_initialized() and self.async_group is None:
            self.async_group = dist.new_group(backend="gloo")
        return self.async_group

    def _retain(self, root: Path) -> None:
        """Delete complete checkpoints beyond the newest keep_last, and leftovers of interrupted saves."""
        for old in complete_checkpoints(root.parent)[:-self.keep_last]:
            (old / COMPLETE).unlink()  # first: a deletion cut short leaves no checkpoint that looks whole
            shutil.rmtree(old)
        for leftover in root.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def load_model(path: Path, model: torch.nn.Module) -> None:
    """Load only the model part of checkpoint `path` into a plain (unsharded) `model` in place, after
    checking that the tensors are the model's and that their files hold every byte of them."""
    metadata = read_metadata(path)
    check_model_fits(path, model, metadata)
    check_files(path, metadata, prefix="model.")
    try:
        dcp.load({"model": model.state_dict()}, storage_reader=SafeReader(path))
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise ScalevecError(str(path), f"cannot be read ({first_failure(e)}).", DAMAGED) from None


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

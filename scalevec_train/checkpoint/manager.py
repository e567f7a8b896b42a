"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resharding on load, never
half-written.

A CheckpointManager saves and loads a dict of stateful objects (anything with state_dict() and
load_state_dict()): those that hold tensors (model, optimizer) through DCP, each rank writing its
own shards; those that hold plain data (the data loader's position, the Stateful callbacks such as
the numerical guard) into train_state.json, readable before any tensor is (files.py has the layout
and the checks).

A save is written into a temporary directory (.tmp_step_000050_<id>). Once every rank has finished
writing and hashed what it wrote (integrity.py), rank 0 adds train_state.json, checksums.json and
COMPLETE and renames the directory to step_000050 (one atomic rename), then deletes checkpoints
beyond the newest `keep_last` and leftovers of interrupted saves. An interrupted save therefore
never replaces the last good checkpoint, and `resume=auto` only ever picks complete ones. A
checkpoint to delete, and one that is written again (a resumed run reaching the same step), is first
renamed away as a leftover, so that a process killed at any moment never leaves a marked directory
with missing files (tests/training/test_faults.py kills at each of these moments).

A write that fails (a full disk, an I/O error) on any rank stops the run: the ranks compare their
outcomes before the marker and after the rename, rank 0 removes the partial folder, and every rank
raises the same CheckpointWriteError (exit code 4) naming the failing rank and error; the previous
complete checkpoint is untouched (docs/guides/reliability.md, "A checkpoint that cannot be
written").

Asynchronous saves (checkpoint.async_save) stage a CPU copy of the state and write it in a
background thread, which talks over its own gloo process group so that its collectives never
interleave with the training's, and then hashes the rank's shard files in the same thread, off the
training's path. The rename happens at the next sync point: the next save, or finish() at the end of
a run.

Resuming on another world size: DCP reshards model and optimizer, and the loader position counts
global samples, so both continue exactly. RNG states are per rank and are restored only on the same
world size (training draws no random numbers today, so losses do not depend on them).
"""

import io
import json
import shutil
import sys
import uuid
from collections.abc import Callable
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

from scalevec_train.checkpoint.config import CheckpointConfig
from scalevec_train.checkpoint.files import (
    DAMAGED,
    STATE_FILE,
    TMP_PREFIX,
    SafeReader,
    check_files,
    check_model_fits,
    checkpoint_root,
    complete_checkpoints,
    first_failure,
    read_metadata,
    step_dir,
)
from scalevec_train.checkpoint.integrity import entry, hash_files, rank_shards, seal
from scalevec_train.infra import progress
from scalevec_train.infra.checksums import digest
from scalevec_train.infra.errors import CheckpointWriteError, ScalevecError
from scalevec_train.infra.faults import checkpoint_writer, fault_point
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.process_group import (
    broadcast_object,
    gather_all,
    is_main,
    new_group,
    rank,
    world_size,
)


class ModelState(Stateful):
    """A model's parameters and buffers as DCP sees them (sharded under FSDP)."""

    def __init__(self, model: Transformer):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState(Stateful):
    """An optimizer's state, keyed by parameter names (so that it reshards with the model). Loading
    keeps the optimizer's own hyperparameters (peak LRs, decays, betas, ...): the resumed run's
    config sets them, as a fresh run's does (torch would restore the saved groups' values
    instead)."""

    def __init__(self, model: Transformer, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        configured = [{k: v for k, v in g.items() if k != "params"}
                      for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, values in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(values)


@dataclass
class _Save:
    """A save in progress: its shards (being) written, not yet renamed into place."""

    step: int
    tmp: Path
    final: Path
    train_state: dict
    rng: dict  # this rank's RNG states at the step saved
    # the async write, then the hashing of this rank's shards: their records
    future: Future | None = None
    error: str | None = None  # this rank's failure to write, in one line
    hashed: dict | None = None  # this rank's files' records for checksums.json, once written


class CheckpointManager:
    """Saves `tensors` (DCP) and `records` (train_state.json) of a run to
    run_dir/checkpoints/step_*; loads them back. `info` is written into every train_state.json as it
    is (e.g. the model config). `optional`: the names of tensor states a checkpoint may lack (an
    option turned on at a resume, such as the weight EMA); they keep their fresh state where it
    does."""

    def __init__(self, run_dir: Path, tensors: dict[str, Stateful], records: dict[str, Stateful],
                 info: dict, keep_last: int, async_save: bool = False,
                 optional: frozenset[str] = frozenset()):
        self.run_dir, self.tensors, self.records, self.info = run_dir, tensors, records, info
        self.keep_last, self.async_save, self.optional = keep_last, async_save, optional
        self.pending: _Save | None = None
        self.async_group = None

    @classmethod
    def from_config(cls, cfg: CheckpointConfig, run_dir: Path, tensors: dict[str, Stateful],
                    records: dict[str, Stateful], info: dict,
                    optional: frozenset[str] = frozenset()) -> "CheckpointManager":
        return cls(run_dir, tensors, records, info, cfg.keep_last, cfg.async_save, optional)

    def save(self, step: int) -> Path:
        """Save a checkpoint of `step`; every rank calls it. Returns the final path (complete on
        return unless async_save: then after the next save() or finish()). Raises
        CheckpointWriteError on every rank if a rank could not write (this save's, or the pending
        async one's)."""
        with progress.current.phase("checkpoint", step):
            return self._save(step)

    def _save(self, step: int) -> Path:
        self.finish()
        final = step_dir(self.run_dir, step)
        tmp = final.parent / broadcast_object(f"{TMP_PREFIX}{step:06d}_{uuid.uuid4().hex[:8]}")
        train_state = {"step": step, "world_size": world_size(),
                       **{name: obj.state_dict() for name, obj in self.records.items()},
                       **self.info}
        save = _Save(step, tmp, final, train_state, _rng_state())

        def make_folder() -> None:
            fault_point("save.folder", step)
            tmp.mkdir(parents=True)

        self._agree(save, _attempt(make_folder) if is_main() else None)
        writer = checkpoint_writer(tmp, step)
        try:
            if self.async_save:
                written = dcp.async_save(self.tensors, storage_writer=writer,
                                         process_group=self._async_group())
                save.future = _then(written, lambda: hash_files(tmp, rank_shards(tmp, rank())))
            else:
                dcp.save(self.tensors, storage_writer=writer)
        # CheckpointException: a rank failed; every rank gets it
        except (OSError, CheckpointException) as e:
            save.error = _failure(e)
        self.pending = save
        if not self.async_save:
            self.finish()
        return final

    def finish(self) -> Path | None:
        """Complete the pending save, if any: wait for its writes on every rank, then rank 0 marks
        it complete and renames it into place. Returns its final path; raises CheckpointWriteError
        on every rank if a rank could not write, once the partial folder is removed."""
        if self.pending is None:
            return None
        done, self.pending = self.pending, None
        with progress.current.phase("checkpoint", done.step):
            return self._finish(done)

    def _finish(self, done: _Save) -> Path:
        self._agree(done, done.error or _attempt(lambda: self._write_rest(done)))
        hashed = {name: record for records in gather_all(done.hashed)
                  for name, record in records.items()}
        self._agree(done, _attempt(lambda: self._complete(done, hashed)) if is_main() else None)
        if is_main():
            self._retain(done.step)
        return done.final

    def _write_rest(self, done: _Save) -> None:
        """This rank's part of `done` on disk, and hashed: its shards (the async write and its
        hashing finished) and its RNG states."""
        if done.future is not None:
            hashed = done.future.result()
        else:
            hashed = hash_files(done.tmp, rank_shards(done.tmp, rank()))
        buffer = io.BytesIO()
        torch.save(done.rng, buffer)
        name = f"rng_rank{rank()}.pt"
        (done.tmp / name).write_bytes(buffer.getvalue())
        done.hashed = {**hashed, name: entry(len(buffer.getvalue()), digest(buffer.getbuffer()))}
        fault_point("save.agree", done.step)

    def _complete(self, done: _Save, hashed: dict[str, dict]) -> None:
        """Rank 0, every rank's files written and hashed (`hashed`: their records): the train state,
        the checksums and the marker, then one rename into place."""
        fault_point("save.state", done.step)
        (done.tmp / STATE_FILE).write_text(json.dumps(done.train_state, indent=1))
        fault_point("save.marker", done.step)
        seal(done.tmp, hashed)
        fault_point("save.rename", done.step)
        # the same step saved before: it becomes a leftover, deleted by _retain
        if done.final.exists():
            _move_away(done.final)
        done.tmp.rename(done.final)

    def _agree(self, save: _Save, error: str | None) -> None:
        """Every rank's outcome so far (None: written); if a rank failed, rank 0 removes the save's
        partial folder and every rank raises the same error."""
        failures = list(dict.fromkeys(e for e in gather_all(error) if e is not None))
        if not failures:
            return
        if is_main():
            shutil.rmtree(save.tmp, ignore_errors=True)
        newest = complete_checkpoints(self.run_dir)
        kept = (f"{newest[-1]} is the newest complete checkpoint, unchanged" if newest
                else "none is complete yet")
        raise CheckpointWriteError(
            str(save.final), f"could not be written ({'; '.join(failures)}). Its partial folder is "
            f"removed; {kept}.",
            f"free space on (or repair) the storage of {save.final.parent}, then continue with "
            "resume=auto.")

    def load(self, path: Path, train_state: dict) -> None:
        """Restore every state from checkpoint `path` (whose train state, already read, is
        `train_state`), resharding to the current world size; the RNG states only when the world
        size is the one the checkpoint was written with."""
        saved = {fqn.split(".", 1)[0] for fqn in read_metadata(path).state_dict_metadata}
        tensors = {k: v for k, v in self.tensors.items() if k in saved or k not in self.optional}
        try:
            dcp.load(tensors, storage_reader=SafeReader(str(path)))
        except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
            raise ScalevecError(str(path), "cannot be loaded into this model/optimizer "
                                f"({first_failure(e)}).",
                                "resume with the config the checkpoint was written with; if it is "
                                "damaged, resume from an older one.") from None
        for name, obj in self.records.items():
            # older checkpoints lack some records: they keep their fresh state
            if name in train_state:
                obj.load_state_dict(train_state[name])
        saved_world = train_state.get("world_size", 1)
        if saved_world == world_size():
            rng_file = path / f"rng_rank{rank()}.pt"
            try:
                rng = torch.load(rng_file, weights_only=True)
            except Exception as e:  # a damaged file shows as any of several exception types
                raise ScalevecError(str(rng_file), f"cannot be read ({type(e).__name__}).",
                                    DAMAGED) from None
            _set_rng_state(rng)
        elif is_main():
            print(f"resume: {path} was written by {saved_world} ranks, this run has "
                  f"{world_size()}: model, optimizer and data position reshard; the per-rank RNG "
                  "states are not restored.", file=sys.stderr)

    def _async_group(self):
        """A gloo group for async saves; created on first use (by every rank, at the same save)."""
        if dist.is_initialized() and self.async_group is None:
            self.async_group = new_group("gloo")
        return self.async_group

    def _retain(self, step: int) -> None:
        """Delete complete checkpoints beyond the newest keep_last, and leftovers of interrupted
        saves. A checkpoint is first renamed out of sight as a leftover (one step: a kill then
        leaves no checkpoint that looks whole with files missing, and no folder that no later save
        deletes)."""
        fault_point("save.retain", step)
        for old in complete_checkpoints(self.run_dir)[:-self.keep_last]:
            _move_away(old)
        fault_point("save.delete", step)
        for leftover in checkpoint_root(self.run_dir).glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _move_away(checkpoint: Path) -> None:
    checkpoint.rename(checkpoint.parent / f"{TMP_PREFIX}{checkpoint.name}_{uuid.uuid4().hex[:8]}")


def _then(first: Future, then: Callable[[], object]) -> Future:
    """A future of then()'s result, which runs once `first` has succeeded, in the thread that
    completes it (DCP's writing thread for an async save): after the write, off the training's
    path."""
    out = Future()

    def run(done: Future) -> None:
        try:
            done.result()
            out.set_result(then())
        except BaseException as e:  # the write's failure, or the hashing's, is the caller's to see
            out.set_exception(e)

    first.add_done_callback(run)
    return out


def _attempt(write: Callable[[], None]) -> str | None:
    """Runs `write`: None once done, or its failure in one line when the storage failed it."""
    try:
        write()
    except (OSError, CheckpointException) as e:
        return _failure(e)
    return None


def _failure(e: BaseException) -> str:
    """A failed write in one line, naming the rank it failed on."""
    failed_rank = min(e.failures) if isinstance(e, CheckpointException) and e.failures else rank()
    return f"rank {failed_rank}: {first_failure(e)}"


def load_model(path: Path, model: torch.nn.Module) -> None:
    """Load only the model part of checkpoint `path` into a plain (unsharded) `model` in place,
    after checking that the tensors are the model's and that their files hold every byte of them."""
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

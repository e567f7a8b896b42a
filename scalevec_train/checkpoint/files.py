"""A checkpoint on disk: where checkpoints live, which are complete, and the checks that run before
any tensor is read (the train state is readable, every file the DCP metadata names is there and long
enough, the saved tensors have the model's names and shapes), so that a damaged checkpoint or one of
another model fails early, naming the file. The DCP metadata is a pickle: it is read with an
unpickler that admits only checkpoint metadata classes, so a crafted checkpoint cannot run code.

Layout: run_dir/checkpoints/step_000050/ holds
    the DCP shards and metadata of model and optimizer  (each rank writes its own shards; and of the
                       weight EMA where the run keeps one, train.ema)
    train_state.json   step, world size, and the plain-data states (the data loader's global sample
                       position, the numerical-guard counters, the model config, the optimizer's
                       name)
    rng_rank<r>.pt     rank r's RNG states
    checksums.json     every other file's size and checksum, recorded as it was written
                       (integrity.py)
    COMPLETE           the marker of a whole checkpoint, holding the checksum of checksums.json
                       (empty, and no checksums.json, in checkpoints written before checksums were
                       recorded)
"""

import io
import json
import pathlib
import pickle
import shutil
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from scalevec_train.infra.errors import ScalevecError, listing

COMPLETE = "COMPLETE"
STATE_FILE = "train_state.json"
TMP_PREFIX = ".tmp_step_"
METADATA_FILE = ".metadata"  # DCP's name for it
AVERAGED = "averaged_from"  # the train_state.json entry of an averaged checkpoint (averaging.py)

# One process without a process group is our normal single-device mode (and how load() and averaging
# read), not a mistake to warn about.
warnings.filterwarnings("ignore",
                        message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

DAMAGED = ("the checkpoint is damaged: use an older one (resume=<its checkpoints/step_* path>, or "
           "scalevec_train.load(<that path>)).")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:06d}"


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint directory (step_dir) holds."""
    return int(checkpoint.name.split("_")[1])


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from: None (fresh), the newest complete one (auto), or a path."""
    if resume == "none":
        if complete_checkpoints(run_dir):
            raise ScalevecError("resume", f"{run_dir} already holds checkpoints and resume=none "
                                "would train over them.",
                                "pass resume=auto to continue that run, or pick another run_dir.")
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ScalevecError("resume", f"{path} does not exist or is not a folder.",
                            "point resume at a checkpoints/step_* folder, or use resume=auto "
                            "or none.")
    if checkpoint_root(path).is_dir():
        raise ScalevecError("resume", f"{path} is a run directory, not a checkpoint.",
                            f"pass run_dir={path} resume=auto to continue it, or point resume at "
                            "one of its checkpoints/step_* folders.")
    if not (path / COMPLETE).is_file():
        raise ScalevecError("resume",
                            f"{path} is not a complete checkpoint (no {COMPLETE} marker).",
                            "point resume at a checkpoints/step_* directory of a finished save, or "
                            "use resume=auto.")
    if AVERAGED in read_train_state(path):
        raise ScalevecError("resume", f"{path} is an averaged checkpoint: it holds the model only, "
                            "no optimizer state or data position to continue from.",
                            "resume from one of the run's own checkpoints/step_* folders; "
                            "evaluate, export or load the average with scalevec_train.load.")
    return path


def read_train_state(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ScalevecError(str(path / STATE_FILE), f"cannot be read ({e}).", DAMAGED) from None


def inspect(path: Path) -> dict:
    """The train state of checkpoint `path` after checking, without reading any tensor, that it is
    well-formed and that every file it needs is there and long enough."""
    state = read_train_state(path)
    where = str(path / STATE_FILE)
    if not isinstance(state, dict):
        raise ScalevecError(where, "is not a JSON object.", DAMAGED)
    for key, kind in (("step", int), ("world_size", int), ("loader", dict), ("model_config", dict)):
        if not isinstance(state.get(key), kind):
            raise ScalevecError(where, f"has no valid {key!r} entry.", DAMAGED)
    if state["step"] < 0 or state["world_size"] < 1:
        raise ScalevecError(where,
                            f"has step={state['step']} and world_size={state['world_size']}.",
                            DAMAGED)
    check_files(path, read_metadata(path))
    for r in range(state["world_size"]):
        if not (path / f"rng_rank{r}.pt").is_file():
            raise ScalevecError(str(path / f"rng_rank{r}.pt"), "is missing.", DAMAGED)
    return state


def check_files(path: Path, metadata: Metadata, prefix: str = "") -> None:
    """Raises unless every file holding a tensor whose name starts with `prefix` exists and is long
    enough for what the metadata says it holds."""
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith(prefix):
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0),
                                            info.offset + info.length)
    for name, need in sorted(sizes.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < need:
            problem = ("is missing" if have is None
                       else f"is truncated: {have} bytes, the metadata needs {need}")
            raise ScalevecError(str(file), f"{problem}.", DAMAGED)


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what a DCP .metadata pickle holds (checkpoint metadata records, sizes, dtypes,
    paths), so that a crafted checkpoint cannot run code when it is inspected, resumed or loaded."""

    def find_class(self, module: str, name: str):
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch"
                and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath",
                                                 "PurePosixPath", "PureWindowsPath"))
            or (module == "collections" and name == "OrderedDict"))
        if not allowed:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        if module == "pathlib":
            return getattr(pathlib, name)
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by _MetadataUnpickler (the base class reads the
    tensors with torch.load(weights_only=True))."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint `path`: which tensors it holds, their shapes and their
    files."""
    file = path / METADATA_FILE
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except FileNotFoundError:
        raise ScalevecError(str(file), "is missing: this is not a whole checkpoint.",
                            DAMAGED) from None
    except Exception as e:  # damaged pickle bytes show as any of several exception types
        raise ScalevecError(str(file), f"cannot be read ({type(e).__name__}: {e}).",
                            DAMAGED) from None
    if not isinstance(metadata, Metadata):
        raise ScalevecError(str(file),
                            f"holds a {type(metadata).__name__}, not checkpoint metadata.", DAMAGED)
    return metadata


def first_failure(e: BaseException) -> str:
    """The first underlying error of a DCP failure, in one line."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def check_model_fits(path: Path, model: torch.nn.Module, metadata: Metadata | None = None) -> None:
    """Raises unless checkpoint `path` holds exactly the tensors of `model`'s state (names and
    shapes; a meta-device model will do)."""
    metadata = metadata or read_metadata(path)
    saved = {k.removeprefix("model."): tuple(getattr(v, "size", ()))
             for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"{k} is {list(saved[k])} in the checkpoint, {list(wanted[k])} in the model"
                for k in sorted(saved.keys() & wanted.keys()) if saved[k] != wanted[k]]
    missing, extra = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
    if missing:
        problems.append(f"missing {listing(missing)}")
    if extra:
        problems.append(f"unexpected {listing(extra)}")
    if problems:
        raise ScalevecError(str(path), f"does not fit this model: {'; '.join(problems[:3])}.",
                            "use the model and scale config of the run that wrote it (for a "
                            "resume: or start a new run_dir).")


def check_new_folder(out: Path) -> None:
    """Raises unless `out` is free for a new folder: absent, or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ScalevecError(str(out), "exists and is not an empty folder.",
                            "remove it or pick another out=.")


@contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` to fill, renamed to `out` when the block ends and removed if
    it raises: `out` appears whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Checkpoint averaging: the elementwise mean of the model tensors of several checkpoints of one run
(the CLI: `python -m scalevec_train.average`).

Every model tensor is averaged, sharded parameters and the fp32 replicated scale sites alike, in
fp64, then stored in the dtype it was saved in. Floating-point buffers are averaged too: the MoE
routers' expert_bias is the load-balancing offset that goes with the router weights, and it moves
slowly and continuously as they do, so the mean bias belongs to the mean router (the last bias would
route the mean router's scores with an offset tuned to other weights). Integer tensors (counters;
none is in a checkpoint today) cannot be averaged: they are taken from the newest checkpoint.

The result is one folder (written whole or not at all) that reads like a checkpoint: DCP shards of
the model only, train_state.json (the newest source's, with `averaged_from`: the source steps and
run, and `step`: the newest source's step, which it stands for), COMPLETE, and a copy of the run's
config.yaml and tokenizer so that `scalevec_train.load(<folder>)`, export and `init_from`-style
loading find what they need wherever the folder lies. It holds no optimizer state and no data
position: it is for evaluation, export and starting new runs, never for resuming
(find_resume refuses it).

The EMA of the weights a run keeps (train.ema.half_life_tokens, training/callbacks/ema.py) lies in
each of its checkpoints beside the model; `ema_model` writes it out as the same kind of folder
(`averaged_from` with `steps`: the checkpoint's step, and `ema`: true), tensors absent from the EMA
(none today) taken from the checkpoint's model.
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from scalevec_train.checkpoint import integrity
from scalevec_train.checkpoint.files import (
    AVERAGED,
    COMPLETE,
    DAMAGED,
    STATE_FILE,
    SafeReader,
    check_files,
    check_new_folder,
    checkpoint_step,
    complete_checkpoints,
    first_failure,
    inspect,
    new_folder,
    read_metadata,
    step_dir,
)
from scalevec_train.data.tokenizer import HF_FILE, SENTENCEPIECE_FILE
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.config import architecture_diff

RUN_FILES = ("config.yaml", SENTENCEPIECE_FILE, HF_FILE)
EMA_PREFIX = "ema.weights."  # the EMA's tensors in a run's checkpoint (training/callbacks/ema.py)


def choose(run_dir: Path, last: int | None = None, steps: list[int] | None = None) -> list[Path]:
    """The checkpoints to average, oldest first: the newest `last` complete ones of run_dir, or
    those of `steps` (exactly one of the two)."""
    if (last is None) == (steps is None):
        raise ScalevecError("average", "needs either last=N or steps=[...].",
                            "pass one of them, e.g. last=3.")
    if not (run_dir / "config.yaml").is_file():
        raise ScalevecError(str(run_dir), "is not a run directory (no config.yaml).",
                            "pass the run_dir of a training run: all checkpoints averaged come "
                            "from one run.")
    found = complete_checkpoints(run_dir)
    if last is not None:
        if last < 2 or last > len(found):
            raise ScalevecError("last", f"is {last}: averaging takes 2 up to the {len(found)} "
                                f"complete checkpoints {run_dir} holds "
                                f"(steps {[checkpoint_step(p) for p in found]}).",
                                "pass last=2 up to that count, or save more often "
                                "(checkpoint.every, checkpoint.keep_last).")
        return found[-last:]
    if len(set(steps)) != len(steps) or len(steps) < 2:
        raise ScalevecError("steps", f"is {steps}: averaging needs at least two distinct steps.",
                            "name each checkpoint once, e.g. steps=[100,200,300].")
    chosen = []
    for step in sorted(steps):
        path = step_dir(run_dir, step)
        if not (path / COMPLETE).is_file():
            raise ScalevecError(str(path), "is not a complete checkpoint (missing, or its save "
                                "was interrupted).",
                                "pick steps among the complete ones: "
                                f"{[checkpoint_step(p) for p in found]}.")
        chosen.append(path)
    return chosen


def read_model(path: Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint `path` (those under `prefix`: "ema.weights." for the EMA),
    whole and in their saved dtypes, read in this process (no process group) whatever number of
    ranks wrote them."""
    metadata = read_metadata(path)
    check_files(path, metadata, prefix=prefix)
    state = {k.removeprefix(prefix): torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in metadata.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    if not state:
        raise ScalevecError(str(path), f"holds no tensors {prefix}*.", DAMAGED)
    keys = prefix.rstrip(".").split(".")
    nested = state
    for key in reversed(keys):  # DCP names nested dicts with dots: {"ema": {"weights": ...}}
        nested = {key: nested}
    try:
        dcp.load(nested, storage_reader=SafeReader(path))
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise ScalevecError(str(path), f"cannot be read ({first_failure(e)}).", DAMAGED) from None
    return state


def check_one_run(checkpoints: list[Path], states: list[dict]) -> None:
    """Raises unless the checkpoints are of one model and not themselves averages."""
    for path, state in zip(checkpoints, states):
        if AVERAGED in state:
            raise ScalevecError(str(path), "is itself an averaged checkpoint.",
                                "average the run's own checkpoints (pass its run_dir).")
        diff = architecture_diff(state["model_config"], states[-1]["model_config"])
        if diff:
            raise ScalevecError(str(path), f"was written by another model than {checkpoints[-1]} "
                                f"(differs in {diff}).", "average checkpoints of one run only.")


def mean(tensors: list[dict[str, torch.Tensor]], where: list[Path]) -> dict[str, torch.Tensor]:
    """The elementwise mean (fp64, stored in each tensor's dtype); integer tensors from the
    newest."""
    names = tensors[-1].keys()
    for path, state in zip(where, tensors):
        if state.keys() != names or any(state[k].shape != tensors[-1][k].shape for k in names):
            raise ScalevecError(str(path), f"holds other tensors than {where[-1]}.",
                                "average checkpoints of one run only.")
    out = {}
    for name, last in tensors[-1].items():
        if last.is_floating_point():
            total = sum(state[name].double() for state in tensors)
            out[name] = (total / len(tensors)).to(last.dtype)
        else:
            out[name] = last.clone()
    return out


def average(run_dir: str | Path, out: str | Path, last: int | None = None,
            steps: list[int] | None = None, verify: bool = True) -> Path:
    """Average checkpoints of run_dir (the newest `last`, or those of `steps`) into the new folder
    `out`; each checked against its checksums first unless verify=False (integrity.py)."""
    run_dir, out = Path(run_dir), Path(out)
    check_new_folder(out)
    checkpoints = choose(run_dir, last, steps)
    if verify:
        for path in checkpoints:
            check_source(path)
    states = [inspect(p) for p in checkpoints]
    check_one_run(checkpoints, states)
    averaged = mean([read_model(p) for p in checkpoints], checkpoints)
    source = {"run_dir": str(run_dir.resolve()), "steps": [checkpoint_step(p) for p in checkpoints]}
    return write_model(out, run_dir, checkpoints[-1], states[-1], averaged, source)


def ema_model(run_dir: str | Path, out: str | Path, step: int | None = None,
              verify: bool = True) -> Path:
    """The EMA of the weights kept in run_dir's checkpoint of `step` (None: the newest complete one)
    as a model in the new folder `out`; the checkpoint checked against its checksums first unless
    verify=False."""
    run_dir, out = Path(run_dir), Path(out)
    check_new_folder(out)
    if not (run_dir / "config.yaml").is_file():
        raise ScalevecError(str(run_dir), "is not a run directory (no config.yaml).",
                            "pass the run_dir of a training run that kept an EMA "
                            "(train.ema.half_life_tokens).")
    found = complete_checkpoints(run_dir)
    if step is None and not found:
        raise ScalevecError(str(run_dir), "holds no complete checkpoint.",
                            "train it with checkpoints (the last step always saves one), or pass "
                            "the run that did.")
    path = found[-1] if step is None else step_dir(run_dir, step)
    if not (path / COMPLETE).is_file():
        raise ScalevecError(str(path), "is not a complete checkpoint.",
                            "pick a step among the complete ones: "
                            f"{[checkpoint_step(p) for p in found]}.")
    if verify:
        check_source(path)
    state = inspect(path)
    check_one_run([path], [state])
    if not any(k.startswith(EMA_PREFIX) for k in read_metadata(path).state_dict_metadata):
        raise ScalevecError(str(path),
                            "holds no EMA of the weights: the run was trained without one.",
                            "train with train.ema.half_life_tokens=<tokens> (a resume may turn it "
                            "on), or average checkpoints instead (last=N).")
    model = read_model(path)
    ema = read_model(path, EMA_PREFIX)
    model.update({k: v.to(model[k].dtype) for k, v in ema.items()})
    source = {"run_dir": str(run_dir.resolve()), "steps": [checkpoint_step(path)], "ema": True}
    return write_model(out, run_dir, path, state, model, source)


def check_source(path: Path) -> None:
    """Raises, naming the file and the newest earlier checkpoint that verifies, unless every file of
    the source checkpoint `path` matches its checksum."""
    integrity.verify(path,
                     lambda good: f"use checkpoints up to {good.name} (steps=[...], ema=<step>)",
                     "pass verify=false")


def write_model(out: Path, run_dir: Path, newest: Path, train_state: dict,
                model: dict[str, torch.Tensor], source: dict) -> Path:
    """The model-only folder `out` (module docstring): `model`'s tensors, the train state of the
    newest source checkpoint `newest` marked with `source`, and the run's files."""
    with new_folder(out) as tmp:
        dcp.save({"model": model}, checkpoint_id=str(tmp))
        # inspect() asks for one RNG file per rank; training draws no random numbers from them.
        shutil.copyfile(newest / "rng_rank0.pt", tmp / "rng_rank0.pt")
        for name in RUN_FILES:
            if (run_dir / name).is_file():
                shutil.copyfile(run_dir / name, tmp / name)
        (tmp / STATE_FILE).write_text(json.dumps({**train_state, "world_size": 1, AVERAGED: source},
                                                 indent=1))
        integrity.seal(tmp, {})
    return out

"""`scalevec_train.load(path)`: a trained model and its tokenizer in one process, without torchrun.

    model, tokenizer = scalevec_train.load("runs/my_run")            # newest complete checkpoint
    model, tokenizer = scalevec_train.load("runs/my_run/checkpoints/step_001000", fold=True, device="cuda")
    logits = model(torch.tensor([tokenizer.encode("def f(x):")]))

A run directory holds config.yaml, tokenizer.model and checkpoints/step_*/ (torch.distributed.checkpoint
format). Only the model part of a checkpoint is read, resharded into one unsharded fp32 model. The
checkpoint's metadata is a pickle: it is read with an unpickler that admits only the checkpoint
metadata classes, and the tensors with torch.load(weights_only=True), so a crafted checkpoint cannot
run code.
"""

from pathlib import Path

import sentencepiece as spm
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from scalevec_train import checkpointing
from scalevec_train.config import Config, to_config
from scalevec_train.data import tokenizer as sp_tokenizer
from scalevec_train.errors import ScalevecError
from scalevec_train.fold import fold as fold_model
from scalevec_train.model import Transformer

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.model"


def load(path: str | Path, fold: bool = False,
         device: str | torch.device = "cpu") -> tuple[Transformer, spm.SentencePieceProcessor]:
    """The model (in eval mode, fp32, on `device`) and the SentencePiece tokenizer of a run directory
    (its newest complete checkpoint) or of one checkpoints/step_* directory. fold=True returns the
    folded model (every foldable scale site absorbed into its linear map; same logits)."""
    run_dir, checkpoint = resolve(Path(path))
    cfg = read_config(run_dir)
    # The tokenizer is cheap to check: a bad one fails before any weight is read.
    tok_path = tokenizer_path(run_dir, cfg)
    tokenizer = sp_tokenizer.load(tok_path)
    if tokenizer.get_piece_size() > cfg.model.vocab_size:
        raise ScalevecError(str(tok_path), f"has {tokenizer.get_piece_size()} pieces, more "
                            f"than the model's vocab_size={cfg.model.vocab_size}.",
                            "put the tokenizer the run trained with next to its config.yaml.")
    model = empty_model(cfg)
    read_model_state(checkpoint, model)
    if fold:
        model = fold_model(model)
    return model.to(device).eval(), tokenizer


def resolve(path: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for a run directory or a checkpoint directory."""
    if not path.exists():
        raise ScalevecError(str(path), "does not exist.", "pass a run directory or one of its "
                            "checkpoints/step_* directories.")
    if (path / checkpointing.COMPLETE).is_file():
        return path.parent.parent, path
    if path.name.startswith("step_") or path.name.startswith(checkpointing.TMP_PREFIX):
        raise ScalevecError(str(path), f"is not a complete checkpoint (no {checkpointing.COMPLETE} marker: "
                            "its save was interrupted).", "use another checkpoint of the run, or the run "
                            "directory (its newest complete checkpoint).")
    if not (path / CONFIG_FILE).is_file():
        raise ScalevecError(str(path), f"is neither a run directory (no {CONFIG_FILE}) nor a checkpoint "
                            f"(no {checkpointing.COMPLETE} marker).", "pass the run_dir of a training run or "
                            "one of its checkpoints/step_* directories.")
    found = checkpointing.complete_checkpoints(path)
    if not found:
        raise ScalevecError(str(path), "holds no complete checkpoint.", "train the run until it saves one "
                            "(checkpoint.every, or the end of the run).")
    return path, found[-1]


def read_config(run_dir: Path) -> Config:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ScalevecError(str(path), "is missing, so the model's shape is unknown.",
                            "pass a checkpoint that sits in its run directory (run_dir/checkpoints/step_*).")
    try:
        raw = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError) as e:
        raise ScalevecError(str(path), f"cannot be read ({str(e).splitlines()[0]}).",
                            "restore the config.yaml the run wrote.") from None
    try:
        return to_config(raw)
    except ScalevecError as e:
        raise ScalevecError(str(path), f"is not a valid scalevec config: {e}",
                            "restore the config.yaml the run wrote.") from None


def empty_model(cfg: Config) -> Transformer:
    """The model of `cfg` on the CPU with uninitialized parameters (they are about to be loaded) and
    computed buffers (RoPE tables)."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    model = model.to_empty(device="cpu")
    model.init_buffers()
    return model


def tokenizer_path(run_dir: Path, cfg: Config) -> Path:
    """run_dir/tokenizer.model (written by the trainer), else the tokenizer the data config names."""
    candidates = [run_dir / TOKENIZER_FILE]
    if cfg.data.tokenizer_path:
        candidates.append(Path(cfg.data.tokenizer_path))
    if cfg.data.source == "shards":
        candidates.append(Path(cfg.data.path) / TOKENIZER_FILE)
    for path in candidates:
        if path.is_file():
            return path
    raise ScalevecError(str(run_dir / TOKENIZER_FILE), "is missing (and the data config names no tokenizer "
                        "file that exists).", f"copy the tokenizer.model the run used into {run_dir} (its data "
                        f"cache holds it: {cfg.data.cache_dir}/{cfg.data.source}-*/tokenizer.model).")


def read_model_state(checkpoint: Path, model: nn.Module) -> None:
    """Load the "model" part of a DCP checkpoint into `model` in place, after checking that its tensor
    names and shapes are the model's and that its files hold every byte of them."""
    metadata = checkpointing.read_metadata(checkpoint)
    expected = model.state_dict()
    saved = {k.removeprefix("model."): v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        problems = ([f"missing {_listing(missing)}"] if missing else []) + (
            [f"unexpected {_listing(unexpected)}"] if unexpected else [])
        raise ScalevecError(str(checkpoint), f"does not hold this model's tensors: {'; '.join(problems)}.",
                            "load it with the config.yaml of the run that wrote it.")
    wrong = [f"{k} is {list(getattr(saved[k], 'size', []))} in the checkpoint, {list(t.shape)} in the model"
             for k, t in expected.items() if tuple(getattr(saved[k], "size", ())) != tuple(t.shape)]
    if wrong:
        raise ScalevecError(str(checkpoint), f"has tensors of other shapes than the model: {_listing(wrong)}.",
                            "load it with the config.yaml of the run that wrote it.")
    _check_file_sizes(checkpoint, metadata)
    try:
        dcp.load({"model": expected}, storage_reader=checkpointing.SafeReader(checkpoint))
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        raise ScalevecError(str(checkpoint), f"cannot be read ({checkpointing.first_failure(e)}).",
                            "the checkpoint is damaged: use another checkpoint of the run.") from None


def _check_file_sizes(checkpoint: Path, metadata: Metadata) -> None:
    for index, info in metadata.storage_data.items():
        if not index.fqn.startswith("model."):
            continue
        path = checkpoint / info.relative_path
        if not path.is_file():
            raise ScalevecError(str(path), f"is missing (it holds {index.fqn}).",
                                "the checkpoint is incomplete: use another checkpoint of the run.")
        size, end = path.stat().st_size, info.offset + info.length
        if size < end:
            raise ScalevecError(str(path), f"is truncated: {size} bytes, but {index.fqn} ends at byte {end}.",
                                "the checkpoint is damaged: use another checkpoint of the run.")


def _listing(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")

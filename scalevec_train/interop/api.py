"""`scalevec_train.load(path)`: a trained model and its tokenizer in one process, without torchrun.

    model, tokenizer = scalevec_train.load("runs/my_run")            # newest complete checkpoint
    model, tokenizer = scalevec_train.load("runs/my_run/checkpoints/step_001000", fold=True,
    device="cuda") logits = model(torch.tensor([tokenizer.encode("def f(x):")]))

A run directory holds config.yaml, its tokenizer (tokenizer.model, or tokenizer.json) and
checkpoints/step_*/ (torch.distributed.checkpoint format). Only the model part of a checkpoint is
read, resharded into one unsharded fp32 model. The checkpoint's metadata is a pickle: it is read
with an unpickler that admits only the checkpoint metadata classes, and the tensors with
torch.load(weights_only=True), so a crafted checkpoint cannot run code.
"""

from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from scalevec_train.checkpoint import integrity
from scalevec_train.checkpoint.files import COMPLETE, TMP_PREFIX, complete_checkpoints
from scalevec_train.checkpoint.manager import load_model
from scalevec_train.config import Config, to_config
from scalevec_train.data import tokenizer as data_tokenizer
from scalevec_train.data.tokenizer import Tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.fold import fold as fold_model
from scalevec_train.model.transformer import Transformer

CONFIG_FILE = "config.yaml"


def load(path: str | Path, fold: bool = False, device: str | torch.device = "cpu",
         verify: bool = True) -> tuple[Transformer, Tokenizer]:
    """The model (in eval mode, fp32, on `device`) and the tokenizer of a run directory (its newest
    complete checkpoint) or of one checkpoints/step_* directory: a SentencePieceProcessor, or for a
    tokenizer.json an HfTokenizer with the same encode/decode/eos_id/get_piece_size. fold=True
    returns the folded model (every foldable scale site absorbed into its linear map; same logits).
    Every file of the checkpoint is checked against the checksums recorded when it was written, and
    a mismatch refuses it (naming the file and the newest earlier checkpoint that verifies);
    verify=False skips the check, for a checkpoint you trust."""
    run_dir, checkpoint = resolve(Path(path))
    if verify:
        integrity.verify(checkpoint, lambda good: f"load {good} instead",
                         "pass verify=False (on the command lines verify=false)")
    cfg = read_config(run_dir)
    # The tokenizer is cheap to check: a bad one fails before any weight is read.
    tok_path = tokenizer_path(run_dir, cfg)
    tokenizer = data_tokenizer.load(tok_path)
    if tokenizer.get_piece_size() > cfg.model.vocab_size:
        raise ScalevecError(str(tok_path), f"has {tokenizer.get_piece_size()} pieces, more "
                            f"than the model's vocab_size={cfg.model.vocab_size}.",
                            "put the tokenizer the run trained with next to its config.yaml.")
    model = empty_model(cfg)
    load_model(checkpoint, model)
    if fold:
        model = fold_model(model)
    return model.to(device).eval(), tokenizer


def resolve(path: Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for a run directory or a checkpoint directory."""
    if not path.exists():
        raise ScalevecError(str(path), "does not exist.", "pass a run directory or one of its "
                            "checkpoints/step_* directories.")
    if (path / COMPLETE).is_file():
        # An averaged checkpoint (checkpoint/averaging.py) carries its run's config and tokenizer.
        return (path if (path / CONFIG_FILE).is_file() else path.parent.parent), path
    if path.name.startswith("step_") or path.name.startswith(TMP_PREFIX):
        raise ScalevecError(str(path), f"is not a complete checkpoint (no {COMPLETE} marker: "
                            "its save was interrupted).",
                            "use another checkpoint of the run, or the run directory (its newest "
                            "complete checkpoint).")
    if not (path / CONFIG_FILE).is_file():
        raise ScalevecError(str(path), f"is neither a run directory (no {CONFIG_FILE}) nor a "
                            f"checkpoint (no {COMPLETE} marker).",
                            "pass the run_dir of a training run or one of its checkpoints/step_* "
                            "directories.")
    found = complete_checkpoints(path)
    if not found:
        raise ScalevecError(str(path), "holds no complete checkpoint.",
                            "train the run until it saves one (checkpoint.every, or the end "
                            "of the run).")
    return path, found[-1]


def read_config(run_dir: Path) -> Config:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ScalevecError(str(path), "is missing, so the model's shape is unknown.",
                            "pass a checkpoint that sits in its run directory "
                            "(run_dir/checkpoints/step_*).")
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
    """The run directory's tokenizer (written by the trainer), else the tokenizer the data config
    names."""
    candidates = [run_dir]
    if cfg.data.tokenizer_path:
        candidates.append(Path(cfg.data.tokenizer_path))
    if cfg.data.source == "shards":
        candidates.append(Path(cfg.data.path))
    for path in candidates:
        found = data_tokenizer.find(path) if path.is_dir() else path if path.is_file() else None
        if found is not None:
            return found
    raise ScalevecError(str(run_dir / data_tokenizer.SENTENCEPIECE_FILE), f"is missing (so is "
                        f"{data_tokenizer.HF_FILE}, and the data config names no tokenizer file "
                        "that exists).",
                        f"copy the tokenizer the run used into {run_dir} (its data cache holds it: "
                        f"{cfg.data.cache_dir}/{cfg.data.source}-*/tokenizer.model or "
                        "tokenizer.json).")

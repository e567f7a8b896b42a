"""Training, identifying and loading the SentencePiece tokenizer."""

import hashlib
import io
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from scalevec_train.errors import ScalevecError

# Settings chosen for source code as much as prose: text passes through unchanged (identity
# normalization, whitespace kept, no dummy prefix) so that decode(encode(text)) == text and indentation
# survives; runs of spaces may become single pieces; newline is a piece of its own since SentencePiece
# trains on lines; unknown characters fall back to bytes, so any text encodes.
_SETTINGS = dict(
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    split_digits=True,
    allow_whitespace_only_pieces=True,
    user_defined_symbols=["\n"],
    character_coverage=0.9995,
    max_sentence_length=8192,
    unk_id=0,
    eos_id=1,
    bos_id=-1,
    pad_id=-1,
)


def settings(vocab_size: int, model_type: str, train_bytes: int) -> dict:
    """Everything that shapes the trained model, for the tokenizer's cache key."""
    return {**_SETTINGS, "vocab_size": vocab_size, "model_type": model_type, "train_bytes": train_bytes,
            "sentencepiece": spm.__version__}


def training_lines(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """The non-blank lines of `texts`, up to about `max_bytes` bytes."""
    used = 0
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                used += len(line.encode())
                yield line
                if used >= max_bytes:
                    return


def train(lines: Iterable[str], vocab_size: int, model_type: str, out: Path) -> None:
    """Trains on `lines` and writes the model to `out` atomically."""
    lines = iter(lines)
    first = next(lines, None)
    if first is None:
        raise ScalevecError("data", "empty corpus: the training documents hold no text.",
                            "point data.source/data.path at text.")
    model = io.BytesIO()
    # One thread: BPE merges depend on the thread count, and one thread costs only ~20% time here,
    # so every machine trains the same tokenizer from the same corpus.
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_chain(first, lines), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, num_threads=1, minloglevel=2, **_SETTINGS)
    except RuntimeError as err:
        raise ScalevecError("data.vocab_size", f"SentencePiece cannot train a {vocab_size}-piece tokenizer "
                            f"on this corpus: {str(err).splitlines()[0]}",
                            "set model.vocab_size (which data.vocab_size follows) within the bound "
                            "SentencePiece names, or use more text.") from None
    write_atomic(out, model.getvalue())


def file_hash(path: Path) -> str:
    """Identifies a tokenizer by its bytes: manifests record it, loaders compare it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(path: Path) -> spm.SentencePieceProcessor:
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as err:
        raise ScalevecError(str(path), f"is not a SentencePiece model: {err}",
                            "point data.tokenizer_path at a .model file.") from None


def write_atomic(path: Path, payload: bytes) -> None:
    """A reader sees either no file or the whole file, even if this process is killed midway."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def threads() -> int:
    """The CPU cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

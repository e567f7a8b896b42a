"""Tokenizers: training scalevec's SentencePiece tokenizer; finding, identifying and loading a
tokenizer of either kind (a SentencePiece .model, or a Hugging Face tokenizer.json:
hf_tokenizer.py).

A folder (prepared data, a run directory) holds one tokenizer, as tokenizer.model or tokenizer.json.
"""

import hashlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece as spm

from scalevec_train.infra.errors import ScalevecError

SENTENCEPIECE_FILE, HF_FILE = "tokenizer.model", "tokenizer.json"


class Tokenizer(Protocol):
    """What scalevec uses of a tokenizer: spm.SentencePieceProcessor has it, HfTokenizer mirrors
    it."""

    def encode(self, input: str | list[str]) -> list[int] | list[list[int]]:
        """Token ids of a text (or of each text of a list), without BOS or EOS."""

    def decode(self, ids: list[int]) -> str: ...

    def eos_id(self) -> int:
        """The id that ends every document in the token stream (-1: none)."""

    def get_piece_size(self) -> int:
        """One more than the highest id: the embedding rows a model needs."""

# Settings chosen for source code as much as prose: text passes through unchanged (identity
# normalization, whitespace kept, no dummy prefix) so that decode(encode(text)) == text and
# indentation survives; runs of spaces may become single pieces; newline is a piece of its own since
# SentencePiece trains on lines; unknown characters fall back to bytes, so any text encodes.
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
    return {**_SETTINGS, "vocab_size": vocab_size, "model_type": model_type,
            "train_bytes": train_bytes, "sentencepiece": spm.__version__}


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
        raise ScalevecError("data.vocab_size",
                            f"SentencePiece cannot train a {vocab_size}-piece tokenizer "
                            f"on this corpus: {str(err).splitlines()[0]}",
                            "set model.vocab_size (which data.vocab_size follows) within the bound "
                            "SentencePiece names, or use more text.") from None
    write_atomic(out, model.getvalue())


def file_hash(path: Path) -> str:
    """Identifies a tokenizer by its bytes: manifests record it, loaders compare it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def resolve(path: Path) -> Path:
    """The tokenizer file a path names: the file itself, or the one a folder holds."""
    path = Path(path)
    if path.is_dir():
        found = find(path)
        if found is None:
            raise ScalevecError(str(path), f"holds no {HF_FILE} or {SENTENCEPIECE_FILE}.",
                                "point data.tokenizer_path at a tokenizer file or a folder holding "
                                "one.")
        return found
    if not path.is_file():
        raise ScalevecError("data.tokenizer_path", f"{path} does not exist.",
                            "point it at a SentencePiece .model file or a tokenizer.json, or clear "
                            "it to train one.")
    return path


def find(folder: Path) -> Path | None:
    """The tokenizer file of a folder (a Hugging Face folder may hold both: its tokenizer.json
    rules)."""
    for name in (HF_FILE, SENTENCEPIECE_FILE):
        if (folder / name).is_file():
            return folder / name
    return None


def file_name(path: Path) -> str:
    """The name a tokenizer file takes in a folder scalevec writes."""
    return HF_FILE if Path(path).suffix == ".json" else SENTENCEPIECE_FILE


def install(path: Path, folder: Path) -> Path:
    """Copies the tokenizer file `path` into `folder` under its kind's name, removing a tokenizer of
    the other kind that an earlier run left there (a folder holds one tokenizer)."""
    name = file_name(path)
    for other in {HF_FILE, SENTENCEPIECE_FILE} - {name}:
        (folder / other).unlink(missing_ok=True)
    shutil.copyfile(path, folder / name)
    return folder / name


def load(path: Path) -> Tokenizer:
    """The tokenizer in a file or folder: a SentencePieceProcessor, or an HfTokenizer for a
    .json."""
    path = resolve(path)
    if path.suffix == ".json":
        from scalevec_train.data.hf_tokenizer import HfTokenizer

        return HfTokenizer(path)
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as err:
        raise ScalevecError(str(path), f"is not a SentencePiece model: {err}",
                            "point data.tokenizer_path at a SentencePiece .model file or a "
                            "tokenizer.json.") from None


def token_bytes(tok: Tokenizer) -> np.ndarray:
    """The UTF-8 bytes of text each id stands for (int64, one per id; 0 for control tokens such as
    EOS, which end documents rather than hold text), for bits per byte. SentencePiece: "▁" is a
    space, and a byte-fallback piece <0xNN> is one byte."""
    if not isinstance(tok, spm.SentencePieceProcessor):
        return tok.token_bytes()
    return np.array([0 if tok.is_control(i) or tok.is_unknown(i) else 1 if tok.is_byte(i)
                     else len(tok.id_to_piece(i).replace("\u2581", " ").encode())
                     for i in range(tok.get_piece_size())],
                    dtype=np.int64)


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

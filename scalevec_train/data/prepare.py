"""Preparation: corpus -> SentencePiece tokenizer -> token shards with manifests, cached on disk.

Cache layout under data.cache_dir:
    tokenizers/<key>.model         key: hash of the corpus fingerprint and the tokenizer settings
    <source>-<key>/tokenizer.model key: hash of the corpus fingerprint, split, tokenizer and shard size
    <source>-<key>/{train,val}/    shards and manifest.json
    .lock                          held while preparing, so concurrent processes prepare only once
A prepared folder is built under a temporary name and renamed when complete, so a killed preparation
never leaves a folder that looks valid. The same folder layout is what data.source=shards reads.
"""

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import sentencepiece as spm

from scalevec_train.data import tokenizer
from scalevec_train.data.config import DataConfig
from scalevec_train.data.corpus import Corpus, open_corpus
from scalevec_train.data.shards import FORMAT, MANIFEST, ShardWriter, open_manifest, scan_token_range
from scalevec_train.data.split import ValSplit
from scalevec_train.errors import ScalevecError

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
TOKENIZER = "tokenizer.model"
_BATCH_CHARS = 1 << 22  # documents are encoded in batches of about this many characters


@dataclass(frozen=True)
class PreparedData:
    root: Path  # folder holding tokenizer.model, train/ and val/
    tokenizer_path: Path
    tokenizer_hash: str  # sha256 of the tokenizer file
    vocab_size: int
    eos_id: int  # ends every document in the token stream
    manifest: dict[str, dict]  # split name -> its manifest

    @property
    def train_dir(self) -> Path:
        return self.split_dir("train")

    @property
    def val_dir(self) -> Path:
        return self.split_dir("val")

    def split_dir(self, split: str) -> Path:
        if split not in self.manifest:
            raise ScalevecError("split", f"unknown split {split!r}.", f"use one of {list(self.manifest)}.")
        return self.root / split

    def load_tokenizer(self) -> spm.SentencePieceProcessor:
        return tokenizer.load(self.tokenizer_path)


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Tokenizer and shards for `cfg`, built on first use and reused (after checks) afterwards."""
    cfg.validate()
    if cfg.source == "shards":
        data = open_prepared(Path(cfg.path), cfg.tokenizer_path, scan=True)
    else:
        data = _prepare_text(cfg)
    check_vocab(data, cfg.vocab_size)
    return data


def check_vocab(data: PreparedData, model_vocab_size: int) -> None:
    """Every token id of `data` must have an embedding row in a model with `model_vocab_size` rows."""
    _check_vocab_size(data.vocab_size, data.tokenizer_path, model_vocab_size)


def _check_vocab_size(vocab_size: int, tok_path: Path, model_vocab_size: int) -> None:
    if vocab_size > model_vocab_size:
        raise ScalevecError("model.vocab_size", f"{model_vocab_size} is smaller than the data's vocabulary "
                            f"of {vocab_size} tokens ({tok_path}).",
                            f"set model.vocab_size >= {vocab_size}, or use a smaller tokenizer.")


def open_prepared(root: Path, tokenizer_path: str | Path = "", scan: bool = False) -> PreparedData:
    """A prepared folder after checking that its manifests, shards and tokenizer agree.

    `scan` also reads every token to check it is below the vocab size; shards we wrote were checked
    while writing, so only foreign ones need it.
    """
    if not root.is_dir():
        raise ScalevecError("data.path", f"{root} is not a folder.",
                            "point it at a folder written by python -m scalevec_train.prepare_data.")
    tok_path = Path(tokenizer_path) if tokenizer_path else root / TOKENIZER
    if not tok_path.is_file():
        raise ScalevecError(str(tok_path), "is missing.",
                            "set data.tokenizer_path to the tokenizer of the shards.")
    tok_hash = tokenizer.file_hash(tok_path)
    sp = tokenizer.load(tok_path)
    manifests = {split: open_manifest(root / split) for split in SPLITS}
    for split, m in manifests.items():
        where = str(root / split / MANIFEST)
        if m["tokenizer_hash"] != tok_hash:
            raise ScalevecError(where, f"was written with tokenizer {m['tokenizer_hash'][:12]}..., but "
                                f"{tok_path} is {tok_hash[:12]}... .",
                                "use the tokenizer the shards were made with, or prepare the data again.")
        if m["vocab_size"] != sp.get_piece_size():
            raise ScalevecError(where, f"says vocab_size={m['vocab_size']}, but {tok_path} has "
                                f"{sp.get_piece_size()} pieces.", "prepare the data again.")
        if m["num_tokens"] == 0:
            raise ScalevecError(where, "lists no tokens.", "prepare the data again from a non-empty corpus.")
        if scan:
            scan_token_range(root / split, m)
    return PreparedData(root=root, tokenizer_path=tok_path, tokenizer_hash=tok_hash,
                        vocab_size=sp.get_piece_size(), eos_id=sp.eos_id(), manifest=manifests)


def _prepare_text(cfg: DataConfig) -> PreparedData:
    corpus = open_corpus(cfg)
    cache = Path(cfg.cache_dir)
    identity = {"source": cfg.source, "corpus": corpus.fingerprint(), "val_fraction": cfg.val_fraction}
    tok_path = _tokenizer_path(cfg, identity, cache)
    if cfg.tokenizer_path:
        _check_vocab_size(tokenizer.load(tok_path).get_piece_size(), tok_path, cfg.vocab_size)
    root = _data_root(cfg, identity, cache, tok_path)
    if root is None or not root.is_dir():
        # All ranks of a job may get here at once on first use: one prepares, the others then find
        # its result instead of racing it with a tokenizer of their own.
        with _exclusive(cache):
            split = None  # made only when needed: it hashes every document key
            if not tok_path.is_file():
                split = ValSplit(cfg.val_fraction, corpus.keys())
                _train_tokenizer(cfg, corpus, split, tok_path)
            root = _data_root(cfg, identity, cache, tok_path)
            if not root.is_dir():
                _build(root, corpus, split or ValSplit(cfg.val_fraction, corpus.keys()), tok_path, cfg)
    return open_prepared(root)


def _tokenizer_path(cfg: DataConfig, identity: dict, cache: Path) -> Path:
    """The configured tokenizer, or where the one trained for this corpus and these settings is cached."""
    if cfg.tokenizer_path:
        path = Path(cfg.tokenizer_path)
        if not path.is_file():
            raise ScalevecError("data.tokenizer_path", f"{path} does not exist.",
                                "point it at a SentencePiece .model file, or clear it to train one.")
        return path
    settings = tokenizer.settings(cfg.vocab_size, cfg.tokenizer_type, cfg.tokenizer_train_bytes)
    return cache / "tokenizers" / f"{_digest({**identity, 'tokenizer': settings})}.model"


def _data_root(cfg: DataConfig, identity: dict, cache: Path, tok_path: Path) -> Path | None:
    """Where the shards for this corpus and tokenizer go; None while the tokenizer does not exist."""
    if not tok_path.is_file():
        return None
    key = {**identity, "tokenizer": tokenizer.file_hash(tok_path), "shard_tokens": cfg.shard_tokens,
           "format": FORMAT}
    return cache / f"{cfg.source}-{_digest(key)}"


@contextmanager
def _exclusive(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        yield


def _train_tokenizer(cfg: DataConfig, corpus: Corpus, split: ValSplit, tok_path: Path) -> None:
    start = time.perf_counter()
    train_texts = (text for key, text in corpus.documents() if not split.is_val(key))
    tokenizer.train(tokenizer.training_lines(train_texts, cfg.tokenizer_train_bytes),
                    cfg.vocab_size, cfg.tokenizer_type, tok_path)
    log.info("trained a %d-piece tokenizer in %.1fs: %s", cfg.vocab_size, time.perf_counter() - start,
             tok_path)


def _build(root: Path, corpus: Corpus, split: ValSplit, tok_path: Path, cfg: DataConfig) -> None:
    start = time.perf_counter()
    tok_hash = tokenizer.file_hash(tok_path)
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        shutil.copyfile(tok_path, tmp / TOKENIZER)
        sp = tokenizer.load(tok_path)
        eos = sp.eos_id()
        if eos < 0:
            raise ScalevecError(str(tok_path), "has no end-of-document (eos) piece to separate documents.",
                                "use a SentencePiece model trained with an eos_id.")
        writers = {s: ShardWriter(tmp / s, sp.get_piece_size(), tok_hash, cfg.shard_tokens) for s in SPLITS}
        docs = dict.fromkeys(SPLITS, 0)
        for keys, texts in _batches(corpus.documents()):
            encoded = sp.encode(texts, num_threads=tokenizer.threads())
            held_out = [split.is_val(key) for key in keys]
            for s in SPLITS:
                chosen = [ids for ids, val in zip(encoded, held_out, strict=True)
                          if ids and val == (s == "val")]
                docs[s] += len(chosen)
                stream = chain.from_iterable(ids + [eos] for ids in chosen)
                writers[s].add(np.fromiter(stream, dtype=np.int64))
        if docs["train"] == 0:
            raise ScalevecError("data", "empty corpus: no training document holds any text.",
                                "point data.source/data.path at text.")
        if docs["val"] == 0:
            raise ScalevecError("data.val_fraction", "no document with text fell into the validation split.",
                                "raise data.val_fraction or add documents.")
        for s, writer in writers.items():
            m = writer.close(split=s, num_documents=docs[s], eos_id=eos,
                             corpus={"source": cfg.source, "path": cfg.path})
            log.info("%s: %d documents, %d tokens", s, docs[s], m["num_tokens"])
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.is_dir():
                raise
            # Another process finished the same preparation first; its folder is equally valid.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s in %.1fs", root, time.perf_counter() - start)


def _batches(documents: Iterator[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    keys, texts, size = [], [], 0
    for key, text in documents:
        keys.append(key)
        texts.append(text)
        size += len(text)
        if size >= _BATCH_CHARS:
            yield keys, texts
            keys, texts, size = [], [], 0
    if keys:
        yield keys, texts


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]

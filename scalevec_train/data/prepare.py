"""Preparation: corpus -> tokenizer -> token shards with manifests, cached on disk.

Cache layout under data.cache_dir:
    tokenizers/<key>.model           key: hash of the corpus fingerprint and the tokenizer settings
    <source>-<key>/tokenizer.model   key: hash of the corpus fingerprint, split, tokenizer and shard
                                     size
        (or tokenizer.json: data.tokenizer_path names a Hugging Face tokenizer)
    <source>-<key>/{train,val}/      shards and manifest.json
    .<source>-<key>.*.parts/         the parts of a preparation in progress (parts.py)
    .lock                            held while preparing (lock.py), so concurrent processes prepare
                                     only once; reading prepared data takes no lock
A prepared folder is built under a temporary name and renamed when complete, so a killed preparation
never leaves a folder that looks valid. The same folder layout is what data.source=shards reads.

prepare_source_share() is one process's share of a preparation that several processes run together
(prepare_data.py under torchrun, or a SLURM array; data.num_workers encoding processes each), and
the last of them to finish merges; one process alone prepares everything. It takes one source:
sources.py prepares what data.* configures, one source or a mixture (mixture.py).
"""

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from scalevec_train.data import tokenizer
from scalevec_train.data.config import DataConfig
from scalevec_train.data.corpus import Corpus, open_corpus
from scalevec_train.data.encode import available_cores
from scalevec_train.data.parts import encode_parts, merge, staging_dir
from scalevec_train.data.shards import FORMAT, MANIFEST, open_manifest, scan_token_range
from scalevec_train.data.split import SPLITS, ValSplit
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import fault_point
from scalevec_train.infra.lock import DirLock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedData:
    root: Path  # folder holding tokenizer.model (or tokenizer.json), train/ and val/
    tokenizer_path: Path
    tokenizer_hash: str  # sha256 of the tokenizer file
    vocab_size: int
    eos_id: int  # ends every document in the token stream
    manifest: dict[str, dict]  # split name -> its manifest

    @property
    def train_dir(self) -> Path:
        return self.split_dir("train")

    def split_dir(self, split: str) -> Path:
        if split not in self.manifest:
            raise ScalevecError("split", f"unknown split {split!r}.",
                                f"use one of {list(self.manifest)}.")
        return self.root / split

    def load_tokenizer(self) -> tokenizer.Tokenizer:
        return tokenizer.load(self.tokenizer_path)


def prepare_source_share(cfg: DataConfig, rank: int, world: int,
                         local_world: int = 1) -> PreparedData | None:
    """Process `rank`'s share of a preparation that `world` processes run together, `local_world` of
    them on this node (sharing its cores): the prepared data, or None while other processes' parts
    are still missing (the last process to finish merges). One process (world=1) prepares
    everything."""
    cfg.validate()
    if cfg.source == "shards":
        data = open_prepared(Path(cfg.path), cfg.tokenizer_path, scan=True)
    else:
        workers = cfg.num_workers or max(1, available_cores() // local_world)
        data = _prepare_text(cfg, rank, world, workers)
        if data is None:
            return None
    check_vocab(data, cfg.vocab_size)
    return data


def check_vocab(data: PreparedData, model_vocab_size: int) -> None:
    """Every token id of `data` must have an embedding row in a model with `model_vocab_size`
    rows."""
    _check_vocab_size(data.vocab_size, data.tokenizer_path, model_vocab_size)


def _check_vocab_size(vocab_size: int, tok_path: Path, model_vocab_size: int) -> None:
    if vocab_size > model_vocab_size:
        raise ScalevecError("model.vocab_size",
                            f"{model_vocab_size} is smaller than the data's vocabulary "
                            f"of {vocab_size} tokens ({tok_path}).",
                            f"set model.vocab_size >= {vocab_size}, or use a smaller tokenizer.")


def open_prepared(root: Path, tokenizer_path: str | Path = "", scan: bool = False) -> PreparedData:
    """A prepared folder after checking that its manifests, shards and tokenizer agree.

    `scan` also reads every token to check it is below the vocab size; shards we wrote were checked
    while writing, so only foreign ones need it.
    """
    if not root.is_dir():
        raise ScalevecError("data.path", f"{root} is not a folder.",
                            "point it at a folder written by python -m "
                            "scalevec_train.prepare_data.")
    tok_path = tokenizer.resolve(tokenizer_path) if tokenizer_path else tokenizer.find(root)
    if tok_path is None:
        raise ScalevecError(str(root / tokenizer.SENTENCEPIECE_FILE),
                            f"is missing (and so is {tokenizer.HF_FILE}).",
                            "set data.tokenizer_path to the tokenizer of the shards.")
    tok_hash = tokenizer.file_hash(tok_path)
    sp = tokenizer.load(tok_path)
    manifests = {split: open_manifest(root / split) for split in SPLITS}
    for split, m in manifests.items():
        where = str(root / split / MANIFEST)
        if m["tokenizer_hash"] != tok_hash:
            raise ScalevecError(where,
                                f"was written with tokenizer {m['tokenizer_hash'][:12]}..., but "
                                f"{tok_path} is {tok_hash[:12]}... .",
                                "use the tokenizer the shards were made with, or prepare the data "
                                "again.")
        if m["vocab_size"] != sp.get_piece_size():
            raise ScalevecError(where, f"says vocab_size={m['vocab_size']}, but {tok_path} has "
                                f"{sp.get_piece_size()} pieces.", "prepare the data again.")
        if m.get("eos_id", sp.eos_id()) != sp.eos_id():
            raise ScalevecError(where,
                                f"says eos_id={m['eos_id']}, but {tok_path} ends documents with "
                                f"{sp.eos_id()}.", "prepare the data again.")
        if m["num_tokens"] == 0:
            raise ScalevecError(where, "lists no tokens.",
                                "prepare the data again from a non-empty corpus.")
        if scan:
            scan_token_range(root / split, m)
    return PreparedData(root=root, tokenizer_path=tok_path, tokenizer_hash=tok_hash,
                        vocab_size=sp.get_piece_size(), eos_id=sp.eos_id(), manifest=manifests)


def _prepare_text(cfg: DataConfig, rank: int, world: int, workers: int) -> PreparedData | None:
    corpus = open_corpus(cfg)
    cache = Path(cfg.cache_dir)
    identity = {"source": cfg.source, "corpus": corpus.fingerprint(),
                "val_fraction": cfg.val_fraction}
    tok_path = _tokenizer_path(cfg, identity, cache)
    if cfg.tokenizer_path:
        _check_vocab_size(tokenizer.load(tok_path).get_piece_size(), tok_path, cfg.vocab_size)
    root = _data_root(cfg, identity, cache, tok_path)
    if root is not None and root.is_dir():
        if staging_dir(root, cfg.part_bytes).is_dir():  # a merge killed before it removed the parts
            with exclusive(cache):
                shutil.rmtree(staging_dir(root, cfg.part_bytes), ignore_errors=True)
        return open_prepared(root)
    split = None  # made only when needed: it hashes every document key
    # All processes of a job may get here at once on first use: one trains the tokenizer, the others
    # then find it instead of racing it with one of their own. One process prepares the shards under
    # the lock too (the other ranks of a training job wait for them); processes that share the work
    # encode their parts outside it and take it only to merge.
    with exclusive(cache):
        if not tok_path.is_file():
            fault_point("prepare.tokenizer", 0, rank)
            # a killed writer's (write_atomic)
            for stale in tok_path.parent.glob(f".{tok_path.name}.*"):
                stale.unlink()
            split = ValSplit(cfg.val_fraction, corpus.keys())
            _train_tokenizer(cfg, corpus, split, tok_path)
        root = _data_root(cfg, identity, cache, tok_path)
        if world == 1 and not root.is_dir():
            _build(cfg, corpus, split, tok_path, root, rank, world, workers)
    if not root.is_dir():
        _build(cfg, corpus, split, tok_path, root, rank, world, workers)
        with exclusive(cache):
            if not root.is_dir() and not _merge(cfg, tok_path, root, rank):
                log.info("process %d of %d: its parts are written; the last process to finish "
                         "merges", rank, world)
                return None
    return open_prepared(root)


def _tokenizer_path(cfg: DataConfig, identity: dict, cache: Path) -> Path:
    """The configured tokenizer, or where the one trained for this corpus and these settings is
    cached."""
    if cfg.tokenizer_path:
        return tokenizer.resolve(Path(cfg.tokenizer_path))
    settings = tokenizer.settings(cfg.vocab_size, cfg.tokenizer_type, cfg.tokenizer_train_bytes)
    return cache / "tokenizers" / f"{digest({**identity, 'tokenizer': settings})}.model"


def _data_root(cfg: DataConfig, identity: dict, cache: Path, tok_path: Path) -> Path | None:
    """Where the shards for this corpus and tokenizer go; None while the tokenizer does not
    exist."""
    if not tok_path.is_file():
        return None
    key = {**identity, "tokenizer": tokenizer.file_hash(tok_path), "shard_tokens": cfg.shard_tokens,
           "format": FORMAT}
    return cache / f"{cfg.source}-{digest(key)}"


@contextmanager
def exclusive(cache: Path) -> Iterator[None]:
    """The cache's lock, waited for: one process writes at a time (released also if the process
    dies)."""
    with DirLock(cache) as lock:
        lock.acquire(wait=True)
        yield


def _train_tokenizer(cfg: DataConfig, corpus: Corpus, split: ValSplit, tok_path: Path) -> None:
    start = time.perf_counter()
    train_texts = (doc.read() for doc in corpus.documents() if not split.is_val(doc.key))
    tokenizer.train(tokenizer.training_lines(train_texts, cfg.tokenizer_train_bytes),
                    cfg.vocab_size, cfg.tokenizer_type, tok_path)
    log.info("trained a %d-piece tokenizer in %.1fs: %s", cfg.vocab_size,
             time.perf_counter() - start, tok_path)


def _build(cfg: DataConfig, corpus: Corpus, split: ValSplit | None, tok_path: Path, root: Path,
           rank: int, world: int, workers: int) -> None:
    """Encodes this process's parts; with one process, merges them too."""
    start = time.perf_counter()
    tok = tokenizer.load(tok_path)
    if tok.eos_id() < 0:
        raise ScalevecError(str(tok_path),
                            "has no end-of-document (eos) piece to separate documents.",
                            "use a SentencePiece model trained with an eos_id.")
    split = split or ValSplit(cfg.val_fraction, corpus.keys())
    encode_parts(corpus.documents(), split, tok_path, staging_dir(root, cfg.part_bytes),
                 cfg.part_bytes, cfg.shard_tokens, tok.get_piece_size(), rank, world, workers)
    if world == 1:
        _merge(cfg, tok_path, root, rank)
        log.info("prepared %s in %.1fs", root, time.perf_counter() - start)


def _merge(cfg: DataConfig, tok_path: Path, root: Path, rank: int) -> bool:
    tok = tokenizer.load(tok_path)
    return merge(staging_dir(root, cfg.part_bytes), root, tok_path, tokenizer.file_hash(tok_path),
                 tok.get_piece_size(), tok.eos_id(), {"source": cfg.source, "path": cfg.path}, rank)


def digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]

"""Small corpora for the data tests: code-like documents written to a folder, their preparation
config, and the prepared splits read back directly (np.fromfile), independently of the loader under
test."""

import random
from pathlib import Path

import numpy as np

from scalevec_train.data import DataConfig, PreparedData

VOCAB = 320
WORDS = ("alpha beta gamma delta import return class def self value index count total None "
         "True False for while if else elif with yield lambda print range list dict set tuple open "
         "read write").split()


def write_corpus(root: Path, n_docs: int = 20, seed: int = 0) -> dict[str, str]:
    """Small code-like documents, some in a subfolder, plus files the corpus must ignore."""
    rng = random.Random(seed)
    docs = {}
    for i in range(n_docs):
        lines = ["    " * rng.randrange(3)
                 + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 10)))
                 + f" {rng.randrange(10_000)}" for _ in range(rng.randrange(20, 40))]
        rel = f"doc{i:02d}.txt" if i % 3 else f"sub/doc{i:02d}.md"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("\n".join(lines) + "\n")
        docs[rel] = (root / rel).read_text()
    (root / "image.bin").write_bytes(b"\x00\x01")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("not part of the corpus")
    return docs


def text_cfg(corpus: Path, cache: Path, **overrides) -> DataConfig:
    # One encoding process unless a test asks for more: workers take seconds to start on a busy
    # machine.
    return DataConfig(**{"source": "text_dir", "path": str(corpus), "cache_dir": str(cache),
                         "vocab_size": VOCAB, "val_fraction": 0.2, "num_workers": 1, **overrides})


def split_tokens(data: PreparedData, split: str) -> np.ndarray:
    m = data.manifest[split]
    return np.concatenate([np.fromfile(data.split_dir(split) / s["name"],
                                       dtype=np.dtype(m["dtype"]))
                           for s in m["shards"]]).astype(np.int64)


def split_texts(data: PreparedData, split: str) -> list[str]:
    """The documents of a split, decoded; each must end with the end-of-document token."""
    tokens = split_tokens(data, split)
    assert tokens[-1] == data.eos_id
    sp = data.load_tokenizer()
    ends = np.flatnonzero(tokens == data.eos_id)
    return [sp.decode(doc[:-1].tolist()) for doc in np.split(tokens, ends + 1)[:-1]]


def folder_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` by its relative path: what byte-identical preparations share."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}

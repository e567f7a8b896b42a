"""Document sources: each yields (key, text) pairs in a fixed order and a cheap fingerprint of its content.

The key names a document stably (a relative file path, a row number); it decides the validation split.
"""

import fnmatch
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from scalevec_train.data.config import DataConfig
from scalevec_train.errors import ScalevecError


class Corpus(Protocol):
    def keys(self) -> list[str] | None:
        """All document keys up front, or None where they are only known by reading (streaming)."""

    def fingerprint(self) -> object:
        """A JSON-able value that changes whenever the documents may have changed; cheap to compute."""

    def documents(self) -> Iterator[tuple[str, str]]:
        """(key, text) pairs, always in the same order."""


class FileCorpus:
    """Every file under `root` whose name matches one of `patterns`; each file is one document.

    Files are listed by walking the tree with sorted names, so the order does not depend on the file
    system. Hidden folders and `skip_dirs` are not entered. With `max_bytes` > 0 only the first files
    up to that many bytes are used.
    """

    def __init__(self, root: Path, patterns: list[str], max_bytes: int = 0,
                 skip_dirs: frozenset[str] = frozenset()):
        self.root = root
        self.files: list[tuple[str, int, int]] = []  # (relative path, size, mtime_ns)
        total = 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
            for name in sorted(filenames):
                if not any(fnmatch.fnmatch(name, p) for p in patterns):
                    continue
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                if max_bytes and total + st.st_size > max_bytes and self.files:
                    return
                total += st.st_size
                self.files.append((Path(os.path.relpath(full, root)).as_posix(), st.st_size, st.st_mtime_ns))

    def keys(self) -> list[str]:
        return [f[0] for f in self.files]

    def fingerprint(self) -> object:
        return {"root": str(self.root.resolve()), "files": self.files}

    def documents(self) -> Iterator[tuple[str, str]]:
        for rel, _, _ in self.files:
            # Decoding errors become U+FFFD: a few odd bytes (the stdlib's encoding tests) must not stop
            # preparation, and byte-fallback tokenizers encode the replacement character like any other.
            yield rel, (self.root / rel).read_bytes().decode("utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def open_corpus(cfg: DataConfig) -> Corpus:
    """The documents of cfg.source (not for source=shards, which holds tokens, not text)."""
    if cfg.source == "stdlib":
        corpus = FileCorpus(stdlib_root(), ["*.py"], cfg.max_corpus_bytes,
                            skip_dirs=frozenset({"site-packages", "dist-packages", "__pycache__"}))
        where, fix = "data.source=stdlib", "this Python has no standard library source; use data=text_dir."
    elif cfg.source == "text_dir":
        root = Path(cfg.path)
        if not root.is_dir():
            raise ScalevecError("data.path", f"{root} is not a folder.",
                                "point data.path at a folder of text files.")
        corpus = FileCorpus(root, list(cfg.patterns), cfg.max_corpus_bytes)
        where, fix = "data.path", f"put files matching data.patterns={list(cfg.patterns)} under {root}."
    elif cfg.source == "hf":
        from scalevec_train.data.hf import HfCorpus
        return HfCorpus(cfg)
    else:
        raise ValueError(f"open_corpus does not read source={cfg.source}")
    if not corpus.files:
        raise ScalevecError(where, f"empty corpus: no files found under {corpus.root}.", fix)
    return corpus

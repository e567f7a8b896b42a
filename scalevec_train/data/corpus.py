"""Document sources: files of the running Python or of a folder here, or the rows of a `datasets`
dataset.

A corpus is documents in a fixed order and a cheap fingerprint of its content. A document's key
names it stably (a relative file path, a row number) and decides the validation split; its size
(bytes of text) is known without reading it, so that a process can step over the documents another
process encodes.

source=hf: the rows of a `datasets` dataset, by hub name or local path.

`datasets` is optional and imported only when rows are read, so that a cache hit needs neither the
package nor the network.
"""

import fnmatch
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from scalevec_train.data.config import DataConfig
from scalevec_train.infra.errors import ScalevecError


@dataclass(frozen=True)
class Document:
    key: str
    size: int  # bytes of text
    read: Callable[[], str]


class Corpus(Protocol):
    def keys(self) -> list[str] | None:
        """All document keys up front, or None where they are only known by reading (streaming)."""

    def fingerprint(self) -> object:
        """A JSON-able value that changes whenever the documents may have changed; cheap to
        compute."""

    def documents(self) -> Iterator[Document]:
        """The documents, always in the same order."""


# Not entered: bytecode caches, and under the standard library its installed packages (python_env
# reads the environment's package folder as a tree of its own).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class FileCorpus:
    """Every file under the `trees` (name, root) whose name matches one of `patterns`; each file is
    one document, keyed by its path relative to its root (under the tree's name, when it has one).

    Files are listed by walking each tree with sorted names, so the order does not depend on the
    file system. Hidden folders and `skip_dirs` are not entered. With `max_bytes` > 0 only the first
    files up to that many bytes are used.
    """

    def __init__(self, trees: list[tuple[str, Path]], patterns: list[str], max_bytes: int = 0,
                 skip_dirs: frozenset[str] = frozenset()):
        self.trees = trees
        self.files: list[tuple[str, int, int]] = []  # (key, size, mtime_ns)
        self.paths: list[str] = []
        total = 0
        for name, root in trees:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames
                                     if not d.startswith(".") and d not in skip_dirs)
                for file in sorted(filenames):
                    if not any(fnmatch.fnmatch(file, p) for p in patterns):
                        continue
                    full = os.path.join(dirpath, file)
                    st = os.stat(full)
                    if max_bytes and total + st.st_size > max_bytes and self.files:
                        return
                    total += st.st_size
                    rel = Path(os.path.relpath(full, root)).as_posix()
                    self.files.append((f"{name}/{rel}" if name else rel, st.st_size,
                                       st.st_mtime_ns))
                    self.paths.append(full)

    def keys(self) -> list[str]:
        return [f[0] for f in self.files]

    def fingerprint(self) -> object:
        if len(self.trees) == 1 and not self.trees[0][0]:
            # the form every single-folder cache so far was keyed by
            return {"root": str(self.trees[0][1].resolve()), "files": self.files}
        return {"roots": [[name, str(root.resolve())] for name, root in self.trees],
                "files": self.files}

    def documents(self) -> Iterator[Document]:
        for (key, size, _), path in zip(self.files, self.paths, strict=True):
            yield Document(key, size, _reader(path))


def _reader(path: str) -> Callable[[], str]:
    # Decoding errors become U+FFFD: a few odd bytes (the stdlib's encoding tests) must not stop
    # preparation, and byte-fallback tokenizers encode the replacement character like any other.
    return lambda: Path(path).read_bytes().decode("utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_env_trees() -> list[tuple[str, Path]]:
    """The standard library, then the folders this environment installs packages into."""
    paths = sysconfig.get_paths()
    trees = [("stdlib", stdlib_root())]
    for name in ("purelib", "platlib"):
        root = Path(paths[name])
        if root.is_dir() and all(root.resolve() != r.resolve() for _, r in trees):
            trees.append((name, root))
    return trees


def open_corpus(cfg: DataConfig) -> Corpus:
    """The documents of cfg.source (not for source=shards, which holds tokens, not text)."""
    if cfg.source == "stdlib":
        corpus = FileCorpus([("", stdlib_root())], ["*.py"], cfg.max_corpus_bytes, _SKIP_DIRS)
        where, fix = ("data.source=stdlib",
                      "this Python has no standard library source; use data=text_dir.")
    elif cfg.source == "python_env":
        corpus = FileCorpus(python_env_trees(), ["*.py"], cfg.max_corpus_bytes, _SKIP_DIRS)
        where, fix = "data.source=python_env", "this Python has no source files; use data=text_dir."
    elif cfg.source == "text_dir":
        root = Path(cfg.path)
        if not root.is_dir():
            raise ScalevecError("data.path", f"{root} is not a folder.",
                                "point data.path at a folder of text files.")
        corpus = FileCorpus([("", root)], list(cfg.patterns), cfg.max_corpus_bytes)
        where, fix = ("data.path",
                      f"put files matching data.patterns={list(cfg.patterns)} under {root}.")
    elif cfg.source == "hf":
        return HfCorpus(cfg)
    else:
        raise ValueError(f"open_corpus does not read source={cfg.source}")
    if not corpus.files:
        roots = ", ".join(str(root) for _, root in corpus.trees)
        raise ScalevecError(where, f"empty corpus: no files found under {roots}.", fix)
    return corpus


# Builders for a single local file, by suffix.
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_ARROW_BATCH = 1024  # rows per Arrow batch


def _as_str(column, row: int) -> str:
    return column[row].as_py()


class HfCorpus:
    """Each row is one document, keyed by its row number; missing texts (None) are skipped.

    A dataset on disk is read in Arrow batches: a row's size comes from the column without making a
    Python string of its text, which only a row that is encoded here needs. A stream is read row by
    row.
    """

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.path = Path(cfg.path)

    def keys(self) -> None:
        return None

    def fingerprint(self) -> object:
        cfg = self.cfg
        # A hub dataset is identified by name only: a new revision upstream is not noticed, so clear
        # data.cache_dir (or change a setting) to re-read it.
        return {"path": cfg.path, "config": cfg.hf_config, "split": cfg.hf_split,
                "field": cfg.text_field, "max_bytes": cfg.max_corpus_bytes,
                "files": _local_files(self.path)}

    def documents(self) -> Iterator[Document]:
        cap, total = self.cfg.max_corpus_bytes, 0
        for i, size, read in self._rows():
            if cap:
                # whole documents only, and at least one however large it is
                if total and total + size > cap:
                    return
                total += size
            yield Document(str(i), size, read)

    def _rows(self) -> Iterator[tuple[int, int, Callable[[], str]]]:
        """(row number, bytes of text, its reader) of every row whose text is not missing."""
        rows = self._load()
        import datasets  # present: _load() needs it

        if not isinstance(rows, datasets.Dataset):
            yield from self._stream(rows)
            return
        import pyarrow as pa
        import pyarrow.compute as pc

        field = self._check_field(rows.column_names)
        kind = rows.data.schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise self._not_text(str(kind))
        i = 0
        for batch in rows.with_format("arrow").iter(batch_size=_ARROW_BATCH):
            column = batch[field]
            for j, size in enumerate(pc.binary_length(column).to_pylist()):
                if size is not None:
                    yield i + j, size, partial(_as_str, column, j)
            i += len(column)

    def _stream(self, rows) -> Iterator[tuple[int, int, Callable[[], str]]]:
        field = self.cfg.text_field
        for i, row in enumerate(rows):
            if i == 0:
                self._check_field(list(row))
            text = row[field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise self._not_text(type(text).__name__)
            yield i, len(text.encode()), partial(str, text)

    def _check_field(self, columns: list[str]) -> str:
        if self.cfg.text_field not in columns:
            raise ScalevecError("data.text_field",
                                f"{self.cfg.text_field!r} is not a column of {self.cfg.path}.",
                                f"use one of {columns}.")
        return self.cfg.text_field

    def _not_text(self, kind: str) -> ScalevecError:
        return ScalevecError("data.text_field",
                             f"column {self.cfg.text_field!r} of {self.cfg.path} holds "
                             f"{kind}, not text.", "name a column of strings.")

    def _load(self):
        try:
            import datasets
        except ImportError:
            raise ScalevecError("data.source",
                                "source=hf needs the `datasets` package, which is not "
                                "installed.", "pip install 'scalevec[hf]'.") from None
        cfg, path = self.cfg, self.path
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise ScalevecError("data.path",
                                    f"{path} is not a .jsonl, .json, .parquet or .arrow file.",
                                    "convert it, or use data=text_dir for plain text files.")
            return datasets.load_dataset(builder, data_files=str(path), split="train",
                                         streaming=cfg.streaming)
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(path))  # a folder written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                if cfg.hf_split not in ds:
                    raise ScalevecError("data.hf_split", f"{path} has no split {cfg.hf_split!r}.",
                                        f"use one of {list(ds)}.")
                ds = ds[cfg.hf_split]
            return ds.to_iterable_dataset() if cfg.streaming else ds
        try:
            return datasets.load_dataset(cfg.path, cfg.hf_config or None, split=cfg.hf_split,
                                         streaming=cfg.streaming)
        except (FileNotFoundError, ValueError, ConnectionError) as err:
            raise ScalevecError("data.path", f"cannot load dataset {cfg.path!r} "
                                f"(hf_config={cfg.hf_config!r}, hf_split={cfg.hf_split!r}): {err}",
                                "check the name or path, data.hf_config and "
                                "data.hf_split.") from None


def _local_files(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the files at a local path; empty for a hub name."""
    if path.is_file():
        st = path.stat()
        return [(path.name, st.st_size, st.st_mtime_ns)]
    found = []
    if path.is_dir():
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                found.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return found

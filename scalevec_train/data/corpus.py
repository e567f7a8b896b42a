"""Document sources (document.py says what one is): files of the running Python or of a folder here;
`datasets` rows in hf.py."""

import fnmatch
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from scalevec_train.data.config import DataConfig
from scalevec_train.data.document import Corpus, Document
from scalevec_train.errors import ScalevecError

# Not entered: bytecode caches, and under the standard library its installed packages (python_env reads
# the environment's package folder as a tree of its own).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class FileCorpus:
    """Every file under the `trees` (name, root) whose name matches one of `patterns`; each file is one
    document, keyed by its path relative to its root (under the tree's name, when it has one).

    Files are listed by walking each tree with sorted names, so the order does not depend on the file
    system. Hidden folders and `skip_dirs` are not entered. With `max_bytes` > 0 only the first files
    up to that many bytes are used.
    """

    def __init__(self, trees: list[tuple[str, Path]], patterns: list[str], max_bytes: int = 0,
                 skip_dirs: frozenset[str] = frozenset()):
        self.trees = trees
        self.files: list[tuple[str, int, int]] = []  # (key, size, mtime_ns)
        self.paths: list[str] = []
        total = 0
        for name, root in trees:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
                for file in sorted(filenames):
                    if not any(fnmatch.fnmatch(file, p) for p in patterns):
                        continue
                    full = os.path.join(dirpath, file)
                    st = os.stat(full)
                    if max_bytes and total + st.st_size > max_bytes and self.files:
                        return
                    total += st.st_size
                    rel = Path(os.path.relpath(full, root)).as_posix()
                    self.files.append((f"{name}/{rel}" if name else rel, st.st_size, st.st_mtime_ns))
                    self.paths.append(full)

    def keys(self) -> list[str]:
        return [f[0] for f in self.files]

    def fingerprint(self) -> object:
        if len(self.trees) == 1 and not self.trees[0][0]:
            # the form every single-folder cache so far was keyed by
            return {"root": str(self.trees[0][1].resolve()), "files": self.files}
        return {"roots": [[name, str(root.resolve())] for name, root in self.trees], "files": self.files}

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
        where, fix = "data.source=stdlib", "this Python has no standard library source; use data=text_dir."
    elif cfg.source == "python_env":
        corpus = FileCorpus(python_env_trees(), ["*.py"], cfg.max_corpus_bytes, _SKIP_DIRS)
        where, fix = "data.source=python_env", "this Python has no source files; use data=text_dir."
    elif cfg.source == "text_dir":
        root = Path(cfg.path)
        if not root.is_dir():
            raise ScalevecError("data.path", f"{root} is not a folder.",
                                "point data.path at a folder of text files.")
        corpus = FileCorpus([("", root)], list(cfg.patterns), cfg.max_corpus_bytes)
        where, fix = "data.path", f"put files matching data.patterns={list(cfg.patterns)} under {root}."
    elif cfg.source == "hf":
        from scalevec_train.data.hf import HfCorpus
        return HfCorpus(cfg)
    else:
        raise ValueError(f"open_corpus does not read source={cfg.source}")
    if not corpus.files:
        roots = ", ".join(str(root) for _, root in corpus.trees)
        raise ScalevecError(where, f"empty corpus: no files found under {roots}.", fix)
    return corpus

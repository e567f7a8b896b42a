"""source=hf: the rows of a `datasets` dataset, by hub name or local path.

`datasets` is optional and imported only when rows are read, so that a cache hit needs neither the
package nor the network.
"""

import os
from collections.abc import Iterator
from pathlib import Path

from scalevec_train.data.config import DataConfig
from scalevec_train.errors import ScalevecError

# Builders for a single local file, by suffix.
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class HfCorpus:
    """Each row is one document, keyed by its row number; empty or missing texts are skipped."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.path = Path(cfg.path)

    def keys(self) -> None:
        return None

    def fingerprint(self) -> object:
        cfg = self.cfg
        # A hub dataset is identified by name only: a new revision upstream is not noticed, so clear
        # data.cache_dir (or change a setting) to re-read it.
        return {"path": cfg.path, "config": cfg.hf_config, "split": cfg.hf_split, "field": cfg.text_field,
                "max_bytes": cfg.max_corpus_bytes, "files": _local_files(self.path)}

    def documents(self) -> Iterator[tuple[str, str]]:
        cfg = self.cfg
        total = 0
        for i, row in enumerate(self._load()):
            if i == 0 and cfg.text_field not in row:
                raise ScalevecError("data.text_field", f"{cfg.text_field!r} is not a column of {cfg.path}.",
                                    f"use one of {list(row)}.")
            text = row[cfg.text_field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ScalevecError("data.text_field", f"column {cfg.text_field!r} of {cfg.path} holds "
                                    f"{type(text).__name__}, not text.", "name a column of strings.")
            if cfg.max_corpus_bytes:
                size = len(text.encode())
                # whole documents only, and at least one however large it is
                if total and total + size > cfg.max_corpus_bytes:
                    return
                total += size
            yield str(i), text

    def _load(self):
        try:
            import datasets
        except ImportError:
            raise ScalevecError("data.source", "source=hf needs the `datasets` package, which is not "
                                "installed.", "pip install 'scalevec[hf]'.") from None
        cfg, path = self.cfg, self.path
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix)
            if builder is None:
                raise ScalevecError("data.path", f"{path} is not a .jsonl, .json, .parquet or .arrow file.",
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
                                "check the name or path, data.hf_config and data.hf_split.") from None


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

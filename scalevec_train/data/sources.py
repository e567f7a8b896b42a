"""Preparing what data.* configures: one source (prepare.py), or each source of a mixture with one
shared tokenizer (mixture.py). Training and the preparation command line come through here."""

import multiprocessing
from pathlib import Path

from scalevec_train.data.config import DataConfig
from scalevec_train.data.mixture import MixtureData, prepare_mixture_share
from scalevec_train.data.prepare import PreparedData, prepare_source_share
from scalevec_train.data.shards import shard_mismatch
from scalevec_train.infra.checksums import ALGORITHM
from scalevec_train.infra.errors import ScalevecError


def prepare_data(cfg: DataConfig) -> PreparedData | MixtureData:
    """Tokenizer and shards for `cfg` (each source's, for a mixture), built on first use and reused (after
    checks) afterwards."""
    data = prepare_share(cfg, 0, 1)
    assert data is not None  # the only process is the last to finish
    return data


def prepare_share(cfg: DataConfig, rank: int, world: int, local_world: int = 1) -> PreparedData | MixtureData | None:
    """Process `rank`'s share of a preparation that `world` processes run together, `local_world` of
    them on this node (sharing its cores): the prepared data, or None while other processes' parts are
    still missing (the last process to finish merges). One process (world=1) prepares everything."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # An encoding worker is importing the main module of the process that started it (spawn), and
        # that module prepares data at import: it would wait forever for the lock its parent holds.
        raise ScalevecError("prepare_data", "was called while a worker process imported the main module.",
                            "call it under `if __name__ == \"__main__\":` in the script that prepares data.")
    if cfg.mixture:
        return prepare_mixture_share(cfg, rank, world, local_world)
    return prepare_source_share(cfg, rank, world, local_world)


_REPREPARE = "delete {root} and prepare the data again (python -m scalevec_train.prepare_data with this data config)"


def shards_of(data: PreparedData | MixtureData) -> list[tuple[Path, dict]]:
    """Every shard of `data` (every source of a mixture) as (its split folder, its manifest entry), the
    largest first: shares dealt out in turn from this list take about as long as one another."""
    prepared = [p for _, p in data.sources] if isinstance(data, MixtureData) else [data]
    found = [(p.split_dir(split), shard) for p in prepared for split, m in p.manifest.items() for shard in m["shards"]]
    return sorted(found, key=lambda item: (-item[1]["num_tokens"], str(item[0] / item[1]["name"])))


def unrecorded(data: PreparedData | MixtureData) -> list[Path]:
    """The split folders of `data` whose manifests record no checksums (prepared before they were)."""
    prepared = [p for _, p in data.sources] if isinstance(data, MixtureData) else [data]
    return [p.split_dir(split) for p in prepared for split, m in p.manifest.items()
            if any(ALGORITHM not in shard for shard in m["shards"])]


def mismatches(shards: list[tuple[Path, dict]]) -> list[tuple[str, str]]:
    """(file, problem) for each of `shards` that records a checksum its file does not match."""
    found = []
    for split_dir, shard in shards:
        if ALGORITHM in shard and (problem := shard_mismatch(split_dir, shard)):
            found.append((str(split_dir / shard["name"]), problem))
    return found


def reprepare(shard_file: str) -> str:
    """How to get a good shard again: prepare its folder again."""
    return _REPREPARE.format(root=Path(shard_file).parent.parent)

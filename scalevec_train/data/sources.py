"""What data.* configures, one source or a weighted mixture, from preparation to the loaders a run
reads.

Prepared: one source (prepare.py), or each source of a mixture with one shared tokenizer
(mixture.py); training and the preparation command come through here. Checked: the token shards
against the checksums their manifests recorded at preparation (shards.py records each as it writes
the shard), at the start of a run (data.verify; each rank reads a share) and by
`python -m scalevec_train.verify`; the manifests' sizes are checked whenever the data is opened, the
checksums need every byte read, so only there. Read: the training loader (one source's, or a
mixture's), the validation batches and the diagnostics' batch; the validation set is the first
`sequences` sequences of the val split in a fixed order (seed 0, whatever the run's seed), split
over the ranks: the same sequences, and so a comparable val_loss, for every seed, world size and
micro-batch (a mixture's sources have one each).
"""

import multiprocessing
from pathlib import Path

from scalevec_train.data.config import DataConfig
from scalevec_train.data.loader import TokenLoader
from scalevec_train.data.mixture import MixtureData, prepare_mixture_share
from scalevec_train.data.mixture_loader import MixtureLoader
from scalevec_train.data.prepare import PreparedData, prepare_source_share
from scalevec_train.data.shards import shard_mismatch
from scalevec_train.infra.checksums import ALGORITHM
from scalevec_train.infra.errors import ScalevecError


def prepare_data(cfg: DataConfig) -> PreparedData | MixtureData:
    """Tokenizer and shards for `cfg` (each source's, for a mixture), built on first use and reused
    (after checks) afterwards."""
    data = prepare_share(cfg, 0, 1)
    assert data is not None  # the only process is the last to finish
    return data


def prepare_share(cfg: DataConfig, rank: int, world: int,
                  local_world: int = 1) -> PreparedData | MixtureData | None:
    """Process `rank`'s share of a preparation that `world` processes run together, `local_world` of
    them on this node (sharing its cores): the prepared data, or None while other processes' parts
    are still missing (the last process to finish merges). One process (world=1) prepares
    everything."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # An encoding worker is importing the main module of the process that started it (spawn),
        # and that module prepares data at import: it would wait forever for the lock its parent
        # holds.
        raise ScalevecError("prepare_data",
                            "was called while a worker process imported the main module.",
                            "call it under `if __name__ == \"__main__\":` in the script that "
                            "prepares data.")
    if cfg.mixture:
        return prepare_mixture_share(cfg, rank, world, local_world)
    return prepare_source_share(cfg, rank, world, local_world)


_REPREPARE = ("delete {root} and prepare the data again (python -m scalevec_train.prepare_data "
              "with this data config)")


def shards_of(data: PreparedData | MixtureData) -> list[tuple[Path, dict]]:
    """Every shard of `data` (every source of a mixture) as (its split folder, its manifest entry),
    the largest first: shares dealt out in turn from this list take about as long as one another."""
    prepared = [p for _, p in data.sources] if isinstance(data, MixtureData) else [data]
    found = [(p.split_dir(split), shard) for p in prepared for split, m in p.manifest.items()
             for shard in m["shards"]]
    return sorted(found, key=lambda item: (-item[1]["num_tokens"], str(item[0] / item[1]["name"])))


def unrecorded(data: PreparedData | MixtureData) -> list[Path]:
    """The split folders of `data` whose manifests record no checksums (prepared before they
    were)."""
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


def training_loader(data: PreparedData | MixtureData, seq_len: int, micro_batch: int, seed: int,
                    rank: int, world: int, documents: bool) -> TokenLoader | MixtureLoader:
    if isinstance(data, MixtureData):
        return MixtureLoader(data, seq_len, micro_batch, seed, rank, world, documents)
    return TokenLoader(data, "train", seq_len, micro_batch, seed, rank, world, documents)


def validation_batches(data: PreparedData | MixtureData, seq_len: int, micro_batch: int,
                       sequences: int, rank: int, world: int,
                       documents: bool) -> list | dict[str, list]:
    """This rank's share of the validation set; of each source's, by name, for a mixture."""
    if isinstance(data, MixtureData):
        return {entry.name: validation_batches(prepared, seq_len, micro_batch, sequences, rank,
                                               world, documents)
                for entry, prepared in data.sources}
    loader = TokenLoader(data, "val", seq_len, micro_batch, 0, rank, world, documents)
    return [loader.next_batch() for _ in range(sequences // (micro_batch * world))]


def diagnostic_batch(data: PreparedData | MixtureData, seq_len: int, micro_batch: int,
                     documents: bool):
    """The batch the diagnostics measure activations on: the val split's first micro_batch sequences
    in the validation order (a mixture's: its first source's), the same on every rank."""
    if isinstance(data, MixtureData):
        data = data.sources[0][1]
    return TokenLoader(data, "val", seq_len, micro_batch, 0, 0, 1, documents).next_batch()

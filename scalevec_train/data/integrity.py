"""Token shards checked against the checksums their manifests recorded at preparation (shards.py records
each as it writes the shard): at the start of a run (data.verify; each rank reads a share, build.py) and
by `python -m scalevec_train.verify`. The manifests' sizes are checked whenever the data is opened
(open_manifest); the checksums need every byte read, so they are checked only there."""

from pathlib import Path

from scalevec_train.checksums import ALGORITHM
from scalevec_train.data.mixture import MixtureData
from scalevec_train.data.prepare import PreparedData
from scalevec_train.data.shards import shard_mismatch

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

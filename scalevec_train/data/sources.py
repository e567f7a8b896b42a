"""Preparing what data.* configures: one source (prepare.py), or each source of a mixture with one
shared tokenizer (mixture.py). Training and the preparation command line come through here."""

import multiprocessing

from scalevec_train.data.config import DataConfig
from scalevec_train.data.mixture import MixtureData, prepare_mixture_share
from scalevec_train.data.prepare import PreparedData, prepare_source_share
from scalevec_train.errors import ScalevecError


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

"""Training sequences drawn from a mixture of sources: global sample i comes from the source and is
the source's sample that data/mixing.py assigns it, read through that source's own TokenLoader (its
window permutation, its max_tokens cap). As for one source, the state is the global sample position
alone, so a run resumes on any world size, or branches, with exactly the samples it would have drawn
next."""

import numpy as np
import torch

from scalevec_train.data.loader import Batch, TokenLoader, checked_position, mean_attended_keys
from scalevec_train.data.mixing import SourceSchedule
from scalevec_train.data.mixture import MixtureData
from scalevec_train.infra import progress
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import fault_point


class MixtureLoader:
    def __init__(self, data: MixtureData, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, documents: bool = False):
        # Each source's loader checks the arguments and maps a source sample to a window; it never
        # advances on its own, so it needs no rank.
        self.sources = [(entry.name, TokenLoader(prepared, "train", seq_len, batch_size, seed, 0, 1,
                                                 documents, entry.max_tokens))
                        for entry, prepared in data.sources]
        if not 0 <= rank < world_size:
            raise ScalevecError("rank", f"{rank} is outside [0, world_size={world_size}).")
        self.schedule = SourceSchedule([entry.weight for entry, _ in data.sources], seed)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.position = 0  # global samples taken by all ranks so far
        self._identity = {"seq_len": seq_len, "seed": seed, "mixture": [
            {"name": name, "weight": entry.weight, **_identity(loader)}
            for (name, loader), (entry, _) in zip(self.sources, data.sources, strict=True)]}

    def next_batch(self) -> Batch:
        """This rank's next batch_size rows (and with `documents`, their document ids)."""
        fault_point("data.batch", progress.current.where[0])
        first = self.position + self.rank * self.batch_size
        self.position += self.world_size * self.batch_size
        return self.read(np.arange(first, first + self.batch_size, dtype=np.int64))

    def read(self, samples: np.ndarray) -> Batch:
        """The batch of global sample indices `samples`: each row read by its source's loader."""
        sources, local = self.schedule.assign(samples)
        parts = [self.sources[k][1].read(local[sources == k]) for k in np.unique(sources).tolist()]
        # the parts hold the rows grouped by source, in order within each: put them back in sample
        # order
        back = torch.from_numpy(np.argsort(np.argsort(sources, kind="stable")))
        return Batch(*(None if field[0] is None else torch.cat(field)[back]
                       for field in zip(*parts, strict=True)))

    def attended_keys(self, samples: int = 1024) -> float:
        """TokenLoader.attended_keys over the first `samples` samples of the mixture."""
        return mean_attended_keys(self.read(np.arange(samples, dtype=np.int64)))

    def epochs_at(self, position: int) -> dict[str, float]:
        """Each source's passes over its training data (its first max_tokens tokens) after
        `position` global samples."""
        counts = self.schedule.counts(position)
        return {name: int(c) / loader.num_windows
                for (name, loader), c in zip(self.sources, counts, strict=True)}

    def state_dict(self) -> dict:
        return {"position": self.position, **self._identity}

    def load_state_dict(self, state: dict) -> None:
        self.position = checked_position(state, self._identity, "data (data.mixture)")


def _identity(loader: TokenLoader) -> dict:
    return {k: v for k, v in loader.state_dict().items() if k != "position"}

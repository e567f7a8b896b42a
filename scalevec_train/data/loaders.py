"""The loaders a run reads its prepared data with: the training loader (one source's, or a mixture's),
the validation batches and the diagnostics' batch. The validation set is the first `sequences`
sequences of the val split in a fixed order (seed 0, whatever the run's seed), split over the ranks: the
same sequences, and so a comparable val_loss, for every seed, world size and micro-batch. A mixture's
sources have one each."""

from scalevec_train.data.loader import TokenLoader
from scalevec_train.data.mixture import MixtureData
from scalevec_train.data.mixture_loader import MixtureLoader
from scalevec_train.data.prepare import PreparedData


def training_loader(data: PreparedData | MixtureData, seq_len: int, micro_batch: int, seed: int, rank: int,
                    world: int, documents: bool) -> TokenLoader | MixtureLoader:
    if isinstance(data, MixtureData):
        return MixtureLoader(data, seq_len, micro_batch, seed, rank, world, documents)
    return TokenLoader(data, "train", seq_len, micro_batch, seed, rank, world, documents)


def validation_batches(data: PreparedData | MixtureData, seq_len: int, micro_batch: int, sequences: int, rank: int,
                       world: int, documents: bool) -> list | dict[str, list]:
    """This rank's share of the validation set; of each source's, by name, for a mixture."""
    if isinstance(data, MixtureData):
        return {entry.name: validation_batches(prepared, seq_len, micro_batch, sequences, rank, world, documents)
                for entry, prepared in data.sources}
    loader = TokenLoader(data, "val", seq_len, micro_batch, 0, rank, world, documents)
    return [loader.next_batch() for _ in range(sequences // (micro_batch * world))]


def diagnostic_batch(data: PreparedData | MixtureData, seq_len: int, micro_batch: int, documents: bool):
    """The batch the diagnostics measure activations on: the val split's first micro_batch sequences in
    the validation order (a mixture's: its first source's), the same on every rank."""
    if isinstance(data, MixtureData):
        data = data.sources[0][1]
    return TokenLoader(data, "val", seq_len, micro_batch, 0, 0, 1, documents).next_batch()

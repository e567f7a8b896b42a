"""What the trainer, its callbacks and the checkpoint manager call on a training loader, written as a type.

TokenLoader (loader.py: one source) and MixtureLoader (mixture_loader.py: weighted sources) are both
Loaders; the trainer types its loader argument with it, EpochMonitor reads it through the trainer, and
tests/data/test_mixtures.py checks that both satisfy it.
"""

from typing import Protocol, runtime_checkable

from scalevec_train.data.loader import Batch


@runtime_checkable
class Loader(Protocol):
    seq_len: int  # tokens of every sequence
    position: int  # global samples drawn by all ranks so far: all the state there is

    def next_batch(self) -> Batch:
        """This rank's next micro-batch (with document ids where the loader was made with documents)."""

    def epochs_at(self, position: int) -> dict[str, float]:
        """Passes over the training data after `position` global samples, by source ("" for one source)."""

    def state_dict(self) -> dict:
        """The position, and what it is only meaningful with (split, seq_len, seed, the data's identity)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; raises unless it was saved for the same data, seq_len and seed."""

"""Fixed-length training sequences drawn deterministically from a split's token stream.

The stream is cut into windows of seq_len + 1 tokens that start every seq_len tokens (neighbours
share one token, so every token is a target once per epoch). Global sample i, counted over all
ranks, is window permute(i mod n, seed, epoch = i div n). A step of the whole job takes world_size *
batch_size consecutive samples, rank r the r-th block of batch_size of them. The state is just the
global sample position, so a run resumes on any world size with exactly the samples it would have
drawn next.

With `documents` (model.attention_mask=document) each batch also gives the rows' document ids, read
from the EOS tokens the stream holds after every document: an EOS belongs to the document it ends,
and the next token starts a new one. The target at an input EOS (the next document's first token,
which nothing its position may attend to predicts) is IGNORE, so it is not counted in the loss.
"""

from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from scalevec_train.data.permutation import permute
from scalevec_train.data.prepare import PreparedData
from scalevec_train.data.shards import TokenStream
from scalevec_train.infra import progress
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import fault_point

IGNORE = -100  # a target the loss does not count (F.cross_entropy's default ignore_index)


class Batch(NamedTuple):
    inputs: torch.Tensor  # int64 [batch, seq]
    targets: torch.Tensor  # the inputs shifted by one token; IGNORE where not counted
    # int64 [batch, seq], each row's documents numbered from 0; None: causal
    doc_ids: torch.Tensor | None


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each input's document within its row: the number of EOS tokens before it."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(-1) - ends


def mean_attended_keys(batch: Batch) -> float:
    """The mean number of keys a query of `batch` attends to under document masking."""
    if batch.doc_ids is None:
        raise ValueError("attended_keys needs a loader made with documents=True")
    seq_len = batch.doc_ids.shape[1]
    lengths = torch.stack([torch.bincount(row, minlength=seq_len)
                           for row in batch.doc_ids]).double()
    return float((lengths * (lengths + 1) / 2).sum() / batch.doc_ids.numel())


class TokenLoader:
    def __init__(self, data: PreparedData, split: str, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, documents: bool = False, max_tokens: int = 0):
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size),
                            ("world_size", world_size)):
            if value < 1:
                raise ScalevecError(name, f"{value} is not positive.")
        if seed < 0:
            raise ScalevecError("seed", f"{seed} is negative.", "use a seed >= 0.")
        if not 0 <= rank < world_size:
            raise ScalevecError("rank", f"{rank} is outside [0, world_size={world_size}).")
        self.stream = TokenStream(data.split_dir(split), data.manifest[split])
        # max_tokens (a mixture source's cap): windows within the split's first max_tokens tokens
        # only
        self.num_windows = (min(self.stream.num_tokens, max_tokens or self.stream.num_tokens)
                            - 1) // seq_len
        if self.num_windows < 1:
            raise ScalevecError(f"data ({split} split)",
                                f"has {self.stream.num_tokens} tokens, too few "
                                f"for one sequence of seq_len + 1 = {seq_len + 1}.",
                                "use a shorter seq_len, more text, or a larger data.val_fraction.")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.eos_id = data.eos_id if documents else None
        self.position = 0  # global samples taken by all ranks so far
        # What a saved position is only meaningful with.
        self._identity = {"split": split, "seq_len": seq_len, "seed": seed,
                          "num_windows": self.num_windows, "num_tokens": self.stream.num_tokens,
                          "tokenizer_hash": data.tokenizer_hash}

    @property
    def epoch(self) -> int:
        return self.position // self.num_windows

    def next_batch(self) -> Batch:
        """This rank's next batch_size rows (and with `documents`, their document ids)."""
        fault_point("data.batch", progress.current.where[0])
        first = self.position + self.rank * self.batch_size
        self.position += self.world_size * self.batch_size
        return self.read(np.arange(first, first + self.batch_size, dtype=np.int64))

    def read(self, samples: np.ndarray) -> Batch:
        """The batch of global sample indices `samples`."""
        rows = np.stack([self.stream.read(int(w) * self.seq_len, self.seq_len + 1)
                         for w in self.windows(samples)])
        tokens = torch.from_numpy(rows)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if self.eos_id is None:
            return Batch(inputs, targets, None)
        return Batch(inputs, targets.masked_fill(inputs == self.eos_id, IGNORE),
                     document_ids(inputs, self.eos_id))

    def attended_keys(self, samples: int = 1024) -> float:
        """The mean number of keys a query attends to under document masking, over the first
        `samples` windows of the sample order: what attention costs per token
        (accounting.train_flops_per_token)."""
        return mean_attended_keys(self.read(np.arange(min(samples, self.num_windows),
                                                      dtype=np.int64)))

    def epochs_at(self, position: int) -> dict[str, float]:
        """Passes over the training data after `position` global samples ({"": passes}; a mixture
        names its sources)."""
        return {"": position / self.num_windows}

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """The window index of each global sample index."""
        epochs, offsets = np.divmod(samples, self.num_windows)
        out = np.empty_like(samples)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = permute(offsets[chosen], self.num_windows, self.seed, int(epoch))
        return out

    def reset(self) -> None:
        """Back to the first sample: a validation loader gives the same batches at every
        evaluation."""
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, **self._identity}

    def load_state_dict(self, state: dict) -> None:
        self.position = checked_position(state, self._identity, "data")


def checked_position(state: dict, identity: dict, data: str) -> int:
    """The sample position of a loader's checkpointed `state`, once every key of `identity` (what
    the samples depend on) matches it; `data` names the data option to resume with."""
    for key, value in identity.items():
        if state.get(key) != value:
            raise ScalevecError(f"data loader state ({key})",
                                f"the checkpoint has {key}={state.get(key)!r}, this run has "
                                f"{value!r}.",
                                f"resume with the checkpoint's {data}, seq_len and seed, or start "
                                "afresh.")
    position = state.get("position")
    if not isinstance(position, int) or position < 0:
        raise ScalevecError("data loader state (position)", f"{position!r} is not a sample count.")
    return position


@runtime_checkable
class Loader(Protocol):
    seq_len: int  # tokens of every sequence
    position: int  # global samples drawn by all ranks so far: all the state there is

    def next_batch(self) -> Batch:
        """This rank's next micro-batch (with document ids where the loader was made with
        documents)."""

    def epochs_at(self, position: int) -> dict[str, float]:
        """Passes over the training data after `position` global samples, by source ("" for one
        source)."""

    def state_dict(self) -> dict:
        """The position, and what it is only meaningful with (split, seq_len, seed, the data's
        identity)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; raises unless it was saved for the same data, seq_len and
        seed."""

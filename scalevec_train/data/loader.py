"""Fixed-length training sequences drawn deterministically from a split's token stream.

The stream is cut into windows of seq_len + 1 tokens that start every seq_len tokens (neighbours share
one token, so every token is a target once per epoch). Global sample i, counted over all ranks, is
window permute(i mod n, seed, epoch = i div n). A step of the whole job takes world_size * batch_size
consecutive samples, rank r the r-th block of batch_size of them. The state is just the global sample
position, so a run resumes on any world size with exactly the samples it would have drawn next.
"""

import numpy as np
import torch

from scalevec_train.data.permutation import permute
from scalevec_train.data.prepare import PreparedData
from scalevec_train.data.shards import TokenStream
from scalevec_train.errors import ScalevecError


class TokenLoader:
    def __init__(self, data: PreparedData, split: str, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("world_size", world_size)):
            if value < 1:
                raise ScalevecError(name, f"{value} is not positive.")
        if seed < 0:
            raise ScalevecError("seed", f"{seed} is negative.", "use a seed >= 0.")
        if not 0 <= rank < world_size:
            raise ScalevecError("rank", f"{rank} is outside [0, world_size={world_size}).")
        self.stream = TokenStream(data.split_dir(split), data.manifest[split])
        self.num_windows = (self.stream.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise ScalevecError(f"data ({split} split)", f"has {self.stream.num_tokens} tokens, too few "
                                f"for one sequence of seq_len + 1 = {seq_len + 1}.",
                                "use a shorter seq_len, more text, or a larger data.val_fraction.")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.position = 0  # global samples taken by all ranks so far
        # What a saved position is only meaningful with.
        self._identity = {"split": split, "seq_len": seq_len, "seed": seed, "num_windows": self.num_windows,
                          "num_tokens": self.stream.num_tokens, "tokenizer_hash": data.tokenizer_hash}

    @property
    def epoch(self) -> int:
        return self.position // self.num_windows

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [batch_size, seq_len]; targets are the inputs shifted by one token."""
        first = self.position + self.rank * self.batch_size
        windows = self.windows(np.arange(first, first + self.batch_size, dtype=np.int64))
        rows = np.stack([self.stream.read(int(w) * self.seq_len, self.seq_len + 1) for w in windows])
        self.position += self.world_size * self.batch_size
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """The window index of each global sample index."""
        epochs, offsets = np.divmod(samples, self.num_windows)
        out = np.empty_like(samples)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = permute(offsets[chosen], self.num_windows, self.seed, int(epoch))
        return out

    def reset(self) -> None:
        """Back to the first sample: a validation loader gives the same batches at every evaluation."""
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position, **self._identity}

    def load_state_dict(self, state: dict) -> None:
        for key, value in self._identity.items():
            if state.get(key) != value:
                raise ScalevecError(f"data loader state ({key})",
                                    f"the checkpoint has {key}={state.get(key)!r}, this run has {value!r}.",
                                    "resume with the checkpoint's data, seq_len and seed, or start afresh.")
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ScalevecError("data loader state (position)", f"{position!r} is not a sample count.")
        self.position = position

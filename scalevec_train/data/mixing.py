"""Which source of a mixture global sample i comes from, and which of that source's samples it is: a
function of i, the seed and the weights alone, so any rank, world size, resume or branch agrees.

The samples are dealt in blocks of BLOCK. Block b gives source k (normalized weights p, cumulative
P_k = p_0 + ... + p_k) the positions u in [P_(k-1), P_k) of the grid u = (j + phase_b) / BLOCK, j <
BLOCK, whose phase steps through the BLOCK values (r + 1/2) / BLOCK in a low-discrepancy order (r =
b * STRIDE mod BLOCK): every BLOCK blocks the phases repeat, so a source's samples before any block
have a closed form, and its share is p_k to about 1 / BLOCK^2 (a source of weight below 1 / BLOCK
gets a sample in about that share of blocks). Within block b the quotas, laid out in source order,
are shuffled by the keyed permutation of range(BLOCK) for (seed, b). Sample i is the c-th sample of
its source, c = its source's samples in earlier blocks plus those before it in its own block; the
source's loader maps c to a window through the source's own permutation.
"""

import numpy as np

from scalevec_train.data.permutation import permute

BLOCK = 1024
# odd, so coprime to BLOCK; about BLOCK / golden ratio, so consecutive phases spread out
STRIDE = 633
# Keys the blocks' shuffles apart from the loaders' window permutations, which use (seed, epoch).
_KEY = 1 << 64


class SourceSchedule:
    def __init__(self, weights: list[float], seed: int):
        p = np.asarray(weights, dtype=np.float64)
        self.cumulative = np.cumsum(p / p.sum())
        self.seed = seed
        self._cycle = self._quotas(np.arange(BLOCK)).sum(0)  # each source's samples in BLOCK blocks
        # the last block laid out
        self._block: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _quotas(self, blocks: np.ndarray) -> np.ndarray:
        """[blocks, sources]: each source's samples in each block."""
        phase = ((blocks * STRIDE) % BLOCK + 0.5) / BLOCK
        edges = np.ceil(BLOCK * self.cumulative[None, :] - phase[:, None]).astype(np.int64)
        # the last edge is the whole block, whatever the rounding of the cumulative sum
        edges[:, -1] = BLOCK
        return np.diff(edges, axis=1, prepend=0)

    def before(self, block: int) -> np.ndarray:
        """Each source's samples in the blocks before `block`."""
        cycles, rest = divmod(block, BLOCK)
        return cycles * self._cycle + self._quotas(np.arange(block - rest, block)).sum(0)

    def _layout(self, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, rank within the source's samples of this block) of each position of `block`, and
        each source's samples before it."""
        if self._block is None or self._block[0] != block:
            quotas = self._quotas(np.array([block]))[0]
            slots = np.repeat(np.arange(quotas.size),
                              quotas)[permute(np.arange(BLOCK), BLOCK, self.seed + _KEY,
                                              block)]
            ranks = np.empty(BLOCK, dtype=np.int64)
            for k in range(quotas.size):
                ranks[slots == k] = np.arange(quotas[k])
            self._block = (block, slots, ranks, self.before(block))
        return self._block[1:]

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index among that source's samples) of each global sample index."""
        sources, local = np.empty_like(samples), np.empty_like(samples)
        blocks, offsets = np.divmod(samples, BLOCK)
        for block in np.unique(blocks):
            chosen = blocks == block
            slots, ranks, before = self._layout(int(block))
            sources[chosen] = slots[offsets[chosen]]
            local[chosen] = before[sources[chosen]] + ranks[offsets[chosen]]
        return sources, local

    def counts(self, n: int) -> np.ndarray:
        """Each source's samples among the first n."""
        block, offset = divmod(n, BLOCK)
        slots, _, before = self._layout(block)
        return before + np.bincount(slots[:offset], minlength=self.cumulative.size)

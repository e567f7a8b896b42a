"""A keyed pseudo-random permutation of range(n), evaluated index by index in O(1) memory.

The loader needs "the j-th window of epoch e" for any j without materializing a shuffled index array
(which for a large corpus would cost gigabytes per rank and time at every resume). A balanced
Feistel network is a bijection on [0, 4^h) for any round function; cycle walking (re-applying it
until the value falls below n) restricts it to a bijection on [0, n).
"""

import numpy as np

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def permute(index: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The images of `index` (values in [0, n)) under the permutation of range(n) keyed by (seed,
    epoch)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = np.random.SeedSequence([seed, epoch]).generate_state(_ROUNDS, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        x[todo] = _feistel(x[todo], keys, half)
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def _feistel(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer: every input bit affects every output bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))

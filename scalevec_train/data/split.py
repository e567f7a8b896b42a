"""Which documents are held out for validation: decided by a hash of each document's key.

Hashing keys (rather than taking every n-th document) keeps a document on the same side when other
documents are added or removed, and needs no second pass over a streamed corpus.
"""

import hashlib

from scalevec_train.infra.errors import ScalevecError

SPLITS = ("train", "val")
_SPACE = 1 << 64


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


class ValSplit:
    """`is_val(key)` is True for held-out documents.

    With the full key list known (file corpora) exactly max(1, round(fraction * n)) documents are
    held out, so that small folders still get a validation split; a streamed corpus holds out each
    document with probability `fraction`.
    """

    def __init__(self, fraction: float, keys: list[str] | None):
        if keys is None:
            self.threshold = int(fraction * _SPACE)
            return
        if len(keys) < 2:
            raise ScalevecError("data",
                                f"the corpus has {len(keys)} document(s); a train/validation split "
                                "needs at least 2.", "add documents (each file is one document).")
        n_val = min(max(1, round(fraction * len(keys))), len(keys) - 1)
        self.threshold = sorted(key_hash(k) for k in keys)[n_val - 1]

    def is_val(self, key: str) -> bool:
        return key_hash(key) <= self.threshold

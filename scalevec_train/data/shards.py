"""Token shards of one split on disk: writing them with their manifest, checking them, reading them.

A split folder holds raw little-endian token files (uint16 when the vocabulary fits, else uint32)
and a manifest.json naming them with their token counts and checksums
(scalevec_train/infra/checksums.py, of the bytes as they were written; absent in folders prepared
before checksums were recorded), the dtype, the vocab size and the hash of the tokenizer that
produced them.
"""

import json
from pathlib import Path

import numpy as np

from scalevec_train.infra.checksums import ALGORITHM, digest, file_digest
from scalevec_train.infra.errors import ScalevecError

FORMAT = "scalevec-tokens-1"
MANIFEST = "manifest.json"
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SCAN_CHUNK = 1 << 24
_REPREPARE = "delete the folder and prepare the data again (python -m scalevec_train.prepare_data)."


def dtype_name(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(index: int) -> str:
    return f"{index:05d}.bin"


class ShardWriter:
    """Appends token arrays to shard files of `shard_tokens` tokens (the last one shorter)."""

    def __init__(self, split_dir: Path, vocab_size: int, shard_tokens: int):
        self.dir = split_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.vocab_size, self.shard_tokens = vocab_size, shard_tokens
        self.dtype = dtype_name(vocab_size)
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.shards: list[dict] = []

    def add(self, tokens: np.ndarray) -> None:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ScalevecError(str(self.dir),
                                f"the tokenizer produced id {int(tokens.max())} outside "
                                f"[0, vocab_size={self.vocab_size}).", "check data.tokenizer_path.")
        self.pending.append(tokens.astype(_DTYPES[self.dtype]))
        self.pending_len += tokens.size
        while self.pending_len >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def finish(self) -> list[dict]:
        """Writes the last shard; returns the shards written, {"name", "num_tokens", ALGORITHM}
        each."""
        if self.pending_len:
            self._flush(self.pending_len)
        return self.shards

    def _flush(self, n: int) -> None:
        tokens = np.concatenate(self.pending)
        name = shard_name(len(self.shards))
        tokens[:n].tofile(self.dir / name)
        self.shards.append({"name": name, "num_tokens": n,
                            ALGORITHM: digest(memoryview(tokens[:n]))})
        rest = tokens[n:]
        self.pending, self.pending_len = ([rest] if rest.size else []), rest.size


def write_manifest(split_dir: Path, vocab_size: int, tokenizer_hash: str, shards: list[dict],
                   **info) -> dict:
    """The manifest of the split folder holding `shards` (with `info` added to it); returns it."""
    manifest = {"format": FORMAT, "dtype": dtype_name(vocab_size), "vocab_size": vocab_size,
                "tokenizer_hash": tokenizer_hash,
                "num_tokens": sum(s["num_tokens"] for s in shards), "shards": shards, **info}
    # Written last: a split folder whose writer died midway has no manifest and is refused.
    (split_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def open_manifest(split_dir: Path) -> dict:
    """The split's manifest, after checking it and the size of every shard file it names."""
    path = split_dir / MANIFEST
    if not path.is_file():
        raise ScalevecError(str(path), "is missing.", _REPREPARE)
    try:
        m = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ScalevecError(str(path), f"is not valid JSON ({err}).", _REPREPARE) from None

    def bad(problem: str) -> ScalevecError:
        return ScalevecError(str(path), problem, _REPREPARE)

    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise bad(f"is not a {FORMAT} manifest.")
    if m.get("dtype") not in _DTYPES:
        raise bad(f"has dtype {m.get('dtype')!r}; expected uint16 or uint32.")
    vocab = m.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise bad(f"has vocab_size {vocab!r}; expected a positive integer.")
    if vocab > 1 << 16 and m["dtype"] == "uint16":
        raise bad(f"stores a {vocab}-token vocabulary as uint16, which holds ids below 65536 only.")
    if not isinstance(m.get("tokenizer_hash"), str):
        raise bad("has no tokenizer_hash.")
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str)
            and Path(s["name"]).name == s["name"]
            and isinstance(s.get("num_tokens"), int) and s["num_tokens"] >= 0
            and isinstance(s.get(ALGORITHM, ""), str) for s in shards):
        raise bad("has a malformed shard list; each entry needs a file name and a num_tokens (and "
                  f"a {ALGORITHM} checksum, if any, in hex).")
    if m.get("num_tokens") != sum(s["num_tokens"] for s in shards):
        raise bad(f"says num_tokens={m.get('num_tokens')!r} but its shards add up to "
                  f"{sum(s['num_tokens'] for s in shards)}.")
    itemsize = _DTYPES[m["dtype"]].itemsize
    for s in shards:
        shard = split_dir / s["name"]
        if not shard.is_file():
            raise bad(f"names shard {s['name']}, which is missing.")
        size, want = shard.stat().st_size, s["num_tokens"] * itemsize
        if size != want:
            state = "truncated" if size < want else "longer than the manifest says"
            raise ScalevecError(str(shard), f"is {state}: {size} bytes, expected {want} "
                                f"({s['num_tokens']} {m['dtype']} tokens).", _REPREPARE)
    return m


def shard_mismatch(split_dir: Path, shard: dict) -> str | None:
    """Why the file of `shard` (a manifest entry that records a checksum) does not match it; None if
    it does."""
    now = file_digest(split_dir / shard["name"])
    if now == shard[ALGORITHM]:
        return None
    return (f"does not match the checksum its manifest recorded at preparation ({ALGORITHM} "
            f"{shard[ALGORITHM]} recorded, {now} read): its bytes changed since.")


def scan_token_range(split_dir: Path, manifest: dict) -> None:
    """Raises if any stored token id is not below the manifest's vocab size (for shards made
    elsewhere)."""
    vocab = manifest["vocab_size"]
    for s in manifest["shards"]:
        if not s["num_tokens"]:
            continue
        tokens = np.memmap(split_dir / s["name"], dtype=_DTYPES[manifest["dtype"]], mode="r")
        for start in range(0, tokens.size, _SCAN_CHUNK):
            top = int(tokens[start:start + _SCAN_CHUNK].max())
            if top >= vocab:
                raise ScalevecError(str(split_dir / s["name"]),
                                    f"holds token id {top} >= vocab_size={vocab} "
                                    "from its manifest.",
                                    "re-tokenize it with the tokenizer the manifest names.")


class TokenStream:
    """All tokens of a split as one sequence, read through memory maps (never loaded whole)."""

    def __init__(self, split_dir: Path, manifest: dict):
        dtype = _DTYPES[manifest["dtype"]]
        self.arrays = [np.memmap(split_dir / s["name"], dtype=dtype, mode="r")
                       for s in manifest["shards"] if s["num_tokens"]]
        self.starts = np.cumsum([0] + [a.size for a in self.arrays])
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {self.num_tokens})")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self.starts[shard])
            take = min(length - done, self.arrays[shard].size - offset)
            out[done:done + take] = self.arrays[shard][offset:offset + take]
            done += take
            shard += 1
        return out

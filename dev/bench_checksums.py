"""What checksums cost (docs/guides/reliability.md, "Checksums"): prints two tables.

1. Throughput of candidate hashes on one core, on a buffer in memory: zlib's CRC-32 and Adler-32,
   hashlib's BLAKE2b and SHA-256, xxhash's XXH64, XXH3-64 (what scalevec records) and XXH3-128, and
   BLAKE3 where the blake3 package is installed (not a dependency of scalevec).
2. A checkpoint save against the checksums it adds: a state of --mb MB (fp32 tensors of 16 MB)
   written with torch.distributed.checkpoint's file writer as a save writes it (one process, files
   synced), then the written files hashed as a save hashes them (read back and XXH3-64:
   integrity.hash_files), and, beside it, read back alone and read back with CRC-32 and BLAKE2b.
   Each row is the median of --repeats saves into a fresh folder.

    python dev/bench_checksums.py --mb 1024 --repeats 5
"""

import argparse
import hashlib
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter

from scalevec_train.checkpoint.integrity import hash_files

CHUNK = 8 << 20


def hashes() -> dict[str, Callable[[], object]]:
    """name -> a new streaming hasher (update(), then digest())."""
    found = {"crc32 (zlib)": lambda: _Running(zlib.crc32),
             "adler32 (zlib)": lambda: _Running(zlib.adler32, 1),
             "blake2b (hashlib)": hashlib.blake2b, "sha256 (hashlib)": hashlib.sha256,
             "xxh64 (xxhash)": xxhash.xxh64, "xxh3_64 (xxhash), recorded": xxhash.xxh3_64,
             "xxh3_128 (xxhash)": xxhash.xxh3_128}
    try:
        import blake3

        found["blake3 (1 thread)"] = blake3.blake3
    except ImportError:
        pass
    return found


class _Running:
    """zlib's running checksums as a hasher."""

    def __init__(self, fn: Callable[[bytes, int], int], start: int = 0):
        self.fn, self.value = fn, start

    def update(self, data) -> None:
        self.value = self.fn(data, self.value)

    def digest(self) -> int:
        return self.value


def throughput(make: Callable[[], object], data: bytes, repeats: int) -> float:
    """GB/s of hashing `data` in CHUNK pieces, best of `repeats`."""
    view, best = memoryview(data), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        hasher = make()
        for at in range(0, len(view), CHUNK):
            hasher.update(view[at:at + CHUNK])
        hasher.digest()
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def read_back(files: list[Path], make: Callable[[], object] | None) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    for file in files:
        hasher = make() if make else None
        with open(file, "rb", buffering=0) as f:
            while size := f.readinto(buffer):
                if hasher:
                    hasher.update(view[:size])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="checkpoint size in MB (table 2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None,
                        help="where to write the checkpoints (default: a temporary folder)")
    args = parser.parse_args()

    data = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy().tobytes()
    print("| hash | GB/s, one core, 256 MB in memory |\n|---|---:|")
    for name, make in hashes().items():
        print(f"| {name} | {throughput(make, data, args.repeats):.2f} |")
    del data

    state = {f"t{i}": torch.randn(4 << 20) for i in range(max(1, args.mb // 16))}
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for repeat in range(args.repeats):
            folder = Path(root) / f"save{repeat}"
            start = time.perf_counter()
            dcp.save(state, storage_writer=FileSystemWriter(folder))
            saved = time.perf_counter()
            names = sorted(p.name for p in folder.iterdir())
            hash_files(folder, names)
            rows.setdefault("the save (dcp.save, files synced)", []).append(saved - start)
            rows.setdefault("its checksums as a save records them (read back + xxh3_64)",
                            []).append(time.perf_counter() - saved)
            files = [folder / n for n in names]
            for label, make in (("read back alone", None),
                                ("read back + crc32", lambda: _Running(zlib.crc32)),
                                ("read back + blake2b", hashlib.blake2b)):
                start = time.perf_counter()
                read_back(files, make)
                rows.setdefault(label, []).append(time.perf_counter() - start)
    save_s = statistics.median(rows["the save (dcp.save, files synced)"])
    size = sum(t.numel() * 4 for t in state.values()) / 1e6
    print(f"\n| {size:.0f} MB checkpoint, median of {args.repeats} | s | of the save |\n"
          "|---|---:|---:|")
    for label, times in rows.items():
        median = statistics.median(times)
        print(f"| {label} | {median:.3f} | {100 * median / save_s:.0f}% |")


if __name__ == "__main__":
    main()

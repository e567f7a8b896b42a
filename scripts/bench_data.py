"""Data preparation throughput: tokens/s with 1 and N encoding workers, next to the tokenizer's own
single-thread encode speed on the same text (the per-core limit), and peak memory.

The corpus is what the overrides after `--` configure (default: data=python_env, the standard
library and the installed packages, a few hundred MB). First the tokenizer is trained once (untimed:
its own cost does not depend on the workers); then each worker count prepares the shards from
scratch, in a fresh process with a cache of its own, timed from start to manifest; then the
tokenizer encodes every document in one thread, timed around the encode calls only (no file
reading). "peak RSS" is the preparing process's peak resident memory; "worker RSS" the largest peak
of its worker processes (read from /proc: Linux).
The shards of every worker count are checked to be byte-identical.

    python scripts/bench_data.py                                   # python_env, 1 and all cores
    python scripts/bench_data.py --workers 1,2,4,8
    python scripts/bench_data.py -- data=stdlib                    # the default corpus (~30 MB)
    python scripts/bench_data.py -- data=text_dir data.path=/my/texts model.vocab_size=32000
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scalevec_train.data import DataConfig, prepare_data, tokenizer
from scalevec_train.data.corpus import open_corpus
from scalevec_train.data.encode import available_cores

# "of limit": tokens/s over workers x the single-thread encode speed (100%: perfect scaling, no
# overhead)
COLUMNS = ["run", "workers", "seconds", "Mtokens/s", "MB/s", "speed-up", "of limit", "peak RSS MiB",
           "worker RSS MiB"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default=f"1,{available_cores()}",
                   help="worker counts, comma-separated")
    p.add_argument("--cache-dir", default="",
                   help="where the runs prepare (default: a temporary folder, removed)")
    # internal: one timed preparation, as JSON
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*",
                   help="Hydra overrides (after --); default data=python_env")
    return p.parse_args()


def peak_mib(pid: int | str) -> float:
    """A process's peak resident memory (VmHWM; unlike rusage, it does not count the pages of the
    parent a process was forked from before it started Python); 0 once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return next(int(line.split()[1]) / 1024 for line in status.splitlines()
                if line.startswith("VmHWM:"))


class WorkerPeak(threading.Thread):
    """The largest peak resident memory of this process's children (the workers), read while they
    run."""

    def __init__(self):
        super().__init__(daemon=True)
        self.mib, self.done = 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
                for pid in children.read_text().split():
                    self.mib = max(self.mib, peak_mib(pid))


def one_preparation(spec: str) -> None:
    """In a fresh process: prepare, print seconds, tokens and peak memory as JSON."""
    cfg = DataConfig(**json.loads(spec))
    peak = WorkerPeak()
    peak.start()
    start = time.perf_counter()
    data = prepare_data(cfg)
    seconds = time.perf_counter() - start
    peak.done.set()
    tokens = sum(m["num_tokens"] for m in data.manifest.values())
    digest = hashlib.sha256()
    for path in sorted(p for p in data.root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(data.root).as_posix().encode() + path.read_bytes())
    print(json.dumps({"seconds": seconds, "tokens": tokens, "digest": digest.hexdigest(),
                      "rss": peak_mib("self"), "worker_rss": peak.mib}))


def encode_speed(cfg: DataConfig, tok_path: Path) -> tuple[float, int]:
    """Seconds the tokenizer spends encoding every document in this thread, and the tokens it
    makes."""
    tok = tokenizer.load(tok_path)
    seconds, tokens = 0.0, 0
    for doc in open_corpus(cfg).documents():
        text = doc.read()
        start = time.perf_counter()
        tokens += len(tok.encode(text))
        seconds += time.perf_counter() - start
    return seconds, tokens


def main() -> int:
    args = parse_args()
    if args.one:
        one_preparation(args.one)
        return 0
    # Imported here, not above: the timed preparations and their workers import this module again,
    # and would otherwise each load Hydra and torch (which the config imports), inflating their
    # memory.
    from scalevec_train.config import compose_config

    cfg = compose_config(args.overrides or ["data=python_env"]).data
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="scalevec_bench_data_"))
    try:
        text_bytes = sum(doc.size for doc in open_corpus(cfg).documents())
        print(f"corpus: data.source={cfg.source} {cfg.path}, {text_bytes / 1e6:.1f} MB of text; "
              f"{available_cores()} cores available", file=sys.stderr)
        tok_path = cache / "tokenizer.model"
        if cfg.tokenizer_path:
            tok_path = tokenizer.resolve(Path(cfg.tokenizer_path))
        elif not tok_path.is_file():
            start = time.perf_counter()
            texts = (doc.read() for doc in open_corpus(cfg).documents())
            tokenizer.train(tokenizer.training_lines(texts, cfg.tokenizer_train_bytes),
                            cfg.vocab_size, cfg.tokenizer_type, tok_path)
            print(f"tokenizer trained in {time.perf_counter() - start:.1f}s (not timed below)",
                  file=sys.stderr)
        runs = {}
        for workers in [int(w) for w in args.workers.split(",")]:
            spec = {**cfg.__dict__, "tokenizer_path": str(tok_path), "num_workers": workers,
                    "cache_dir": str(cache / f"workers-{workers}")}
            done = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                  capture_output=True, text=True, check=True)
            runs[workers] = json.loads(done.stdout.strip().splitlines()[-1])
        encode_seconds, encode_tokens = encode_speed(cfg, tok_path)
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
    limit = encode_tokens / encode_seconds  # tokens/s of one core that only encodes
    base = next(iter(runs.values()))["seconds"]
    rows = [["encode only, 1 thread", "", f"{encode_seconds:.1f}", f"{limit / 1e6:.3f}",
             f"{text_bytes / encode_seconds / 1e6:.2f}", "", "100%", "", ""]]
    for workers, r in runs.items():
        rate = r["tokens"] / r["seconds"]
        rows.append(["prepare", str(workers), f"{r['seconds']:.1f}", f"{rate / 1e6:.3f}",
                     f"{text_bytes / r['seconds'] / 1e6:.2f}", f"{base / r['seconds']:.2f}x",
                     f"{100 * rate / (workers * limit):.0f}%", f"{r['rss']:.0f}",
                     f"{r['worker_rss']:.0f}" if workers > 1 else ""])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |")
    identical = len({r["digest"] for r in runs.values()}) == 1
    print(f"\nshards byte-identical across worker counts: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

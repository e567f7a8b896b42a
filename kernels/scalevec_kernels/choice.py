"""What `backend="auto"` runs inside torch.compile, per op and shape: the fused kernel, or the plain
reference (which torch.compile turns into its own Triton code), whichever the latest measurements on
a GPU found faster (forward + backward at its micro-batch, measured/<date>-<device>.json: the date,
the device and the versions are in the file).

A shape the table measured takes the faster one; a shape it did not measure takes the pick of the
nearest measured width of the same op and outputs (K, or per-expert scales) within a factor of two;
beyond that, the fused kernel (one pass over the row, where the reference's unfused ops take
several). Every pick comes with its reason. Outside torch.compile, `auto` runs the fused kernels:
there the reference would run as separate eager ops.
"""

import json
import math
from pathlib import Path

MEASURED = Path(__file__).with_name("measured")
# How far (a factor) a measured width may be from a call's to stand for it
NEAREST = 2.0
# The latest table (file names sort by date), read at import: torch.compile traces `faster` inside
# a compiled forward, and cannot trace a file read (pathlib's glob calls sys.audit)
TABLE = json.loads(sorted(MEASURED.glob("*.json"))[-1].read_text())


def nearest(op: str, n: int, k: int = 1, experts: int = 0) -> dict | None:
    """The measurement that stands for a call of `op` on rows of n features with k outputs
    (rms_norm) or per-expert scales over `experts` experts (swiglu_norm; 0: shared): the same op, K
    and kind of scales at the nearest width within NEAREST (the smaller of two as near); None if
    none. Plain loops and comparisons, which torch.compile traces to a constant."""
    best, key = None, None
    for m in TABLE["measurements"]:
        if m["op"] != op or m.get("k", 1) != k or bool(m.get("experts", 0)) != bool(experts):
            continue
        distance = abs(math.log2(m["n"] / n))
        if distance <= math.log2(NEAREST) and (key is None or (distance, m["n"]) < key):
            best, key = m, (distance, m["n"])
    return best


def faster(op: str, n: int, k: int = 1, experts: int = 0) -> str:
    """"fused" or "compile" for a call (nearest's arguments): what `auto` runs inside
    torch.compile."""
    return _winner(nearest(op, n, k, experts))


def _winner(m: dict | None) -> str:
    """The faster of a measurement; the fused kernel (one pass over the row) where none stands."""
    return "fused" if m is None or m["fused"] <= m["compile"] else "compile"


def pick(op: str, n: int, k: int = 1, experts: int = 0) -> tuple[str, str]:
    """(faster(...), why) for a call (nearest's arguments)."""
    m = nearest(op, n, k, experts)
    if m is None:
        what = (f"K = {k}" if op == "rms_norm"
                else ("per-expert scales" if experts else "shared scales"))
        return "fused", (f"not measured (no width within {NEAREST:g}x of {n} with {what}): "
                         "the fused kernel, one pass")
    t = TABLE
    where = f"{t['device']}, {t['date']}, torch {t['torch']}, Triton {t['triton']}"
    shape = "measured" if m["n"] == n else f"nearest measured width {m['n']}"
    return _winner(m), (
        f"{shape}: fused {m['fused']:g} us, compile {m['compile']:g} us "
        f"({m['time']} time, {t['rows']} rows, forward + backward; {where})")

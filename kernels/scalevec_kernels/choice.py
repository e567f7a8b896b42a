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

import functools
import json
import math
from pathlib import Path

MEASURED = Path(__file__).with_name("measured")
# How far (a factor) a measured width may be from a call's to stand for it
NEAREST = 2.0


@functools.cache
def table() -> dict:
    """The latest table (file names sort by date)."""
    return json.loads(sorted(MEASURED.glob("*.json"))[-1].read_text())


def pick(op: str, n: int, k: int = 1, experts: int = 0) -> tuple[str, str]:
    """("fused" or "compile", why) for `op` ("rms_norm", "swiglu_norm") on rows of n features with k
    outputs (rms_norm) or per-expert scales over `experts` experts (swiglu_norm; 0: shared)."""
    t = table()
    where = f"{t['device']}, {t['date']}, torch {t['torch']}, Triton {t['triton']}"
    same = [m for m in t["measurements"] if m["op"] == op and m.get("k", 1) == k
            and bool(m.get("experts", 0)) == bool(experts)]
    near = [m for m in same if abs(math.log2(m["n"] / n)) <= math.log2(NEAREST)]
    if not near:
        what = (f"K = {k}" if op == "rms_norm"
                else ("per-expert scales" if experts else "shared scales"))
        return "fused", (f"not measured (no width within {NEAREST:g}x of {n} with {what}): "
                         "the fused kernel, one pass")
    m = min(near, key=lambda m: (abs(math.log2(m["n"] / n)), m["n"]))
    faster = "fused" if m["fused"] <= m["compile"] else "compile"
    shape = "measured" if m["n"] == n else f"nearest measured width {m['n']}"
    return faster, (f"{shape}: fused {m['fused']:g} us, compile {m['compile']:g} us "
                    f"({m['time']} time, {t['rows']} rows, forward + backward; {where})")

"""The memory traffic of a compiled kernel variant, proven from its SASS and its launch
configuration (no GPU): how often each large tensor is read and written, how much of it leaves the
chip, how wide the accesses are, and how many bytes each SM keeps in flight, against the H100/H200
figures below.

A kernel of these norms moves rows: its large tensors are [rows, N] (x, the outputs, the gradients),
the rest (scales, inverse RMS, partial sums) is per column or per row and left out. For each large
tensor, the SASS gives the bytes a tile's loads and stores touch (bytes per lane x 32 lanes x warps
for each instruction, once per tile of BLOCK_M x BLOCK_N elements: each access sits in the body of
the loop over tiles or, chunked, over a row's chunks), so reads = those bytes over the tile's. A
tensor read twice (a chunked row: the reduction, then the outputs) leaves the chip once when the
second read is served by L2: when what the device reads and writes between the two (the resident
programs' rows, at the widest width the variant is launched with) fits in half the L2. Bytes per
call over the floor (each large tensor once) follow from those counts.

In flight: a warp issues its loads and waits at the first instruction that needs one of them
(sass.py); the large tensors' bytes of the smallest such batch, times the warps resident on an SM
(the programs an SM holds at once by registers and shared memory, at most what the grid gives it: a
forward's grid of one program per tile of rows has many per SM at the presets' micro-batches of
16384 tokens and more), is what an SM keeps in flight; a row narrower than its tile, or whose last
chunk is partial, leaves lanes idle, so it counts the share it keeps busy (backend.active_share) at
the narrowest width launched. Little's law asks for backend.IN_FLIGHT_NEEDED (bandwidth x latency /
SMs, the figures and their source are there: 29,091 bytes for an H200). One resident program per SM
cannot overlap its own reduction and stores with loads, so at least two are asked for as well.
"""

import dataclasses
import importlib

from scalevec_kernels import backend
from scalevec_kernels.backend import (
    IN_FLIGHT_NEEDED,
    MIN_PROGRAMS_PER_SM,
    active_share,
    l2_holds,
    rows_in_progress,
)

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One variant's memory model on an H100/H200. Per large tensor: reads and writes per tile (1:
    once)."""
    reads: dict
    writes: dict
    off_chip_reads: dict
    bytes_over_floor: float
    vector_bytes: int  # the narrowest large-tensor access, bytes per lane
    # large-tensor bytes a warp has in flight before it first waits (the smallest batch)
    warp_bytes: int
    programs_per_sm: int
    warps: int
    working_set: int  # bytes between a chunk's two reads, device-wide; 0 when nothing is read twice

    @property
    def in_flight(self) -> int:
        """Bytes an SM keeps in flight."""
        return self.programs_per_sm * self.warps * self.warp_bytes

    def problems(self) -> list[str]:
        out = [f"reads {arg} {n:g} times off the chip" for arg, n in self.off_chip_reads.items()
               if n > 1]
        out += [f"writes {arg} {n:g} times" for arg, n in self.writes.items() if n != 1]
        if self.in_flight < IN_FLIGHT_NEEDED:
            out.append(f"keeps {self.in_flight} B in flight per SM, under the {IN_FLIGHT_NEEDED} "
                       "B an H200 needs")
        if self.programs_per_sm < MIN_PROGRAMS_PER_SM:
            out.append(f"holds {self.programs_per_sm} program per SM: nothing loads while it "
                       "reduces and stores")
        return out


def row_args(variant) -> tuple[str, ...]:
    """The kernel's large ([rows, N]) tensor arguments, as its module declares them (ROW_ARGS)."""
    module, name = variant.kernel.split(".")
    return importlib.import_module(f"scalevec_kernels.{module}").ROW_ARGS[name]


def programs_per_sm(variant, usage) -> int:
    """Programs an SM holds at once: by registers and shared memory, at most what the grid gives it
    (a backward's persistent grid is sized to WARPS_PER_SM warps an SM)."""
    fits = usage.blocks_per_sm(variant.num_warps)
    if variant.kernel.endswith("_bwd_kernel"):
        return min(fits, max(1, backend.WARPS_PER_SM // variant.num_warps))
    return fits


def traffic(variant, usage, widths: set[int]) -> Traffic:
    """The memory model of `variant` compiled as `usage` (with its SASS), launched on rows of
    `widths`: in flight at the width that keeps the fewest lanes busy, the L2's working set at the
    widest."""
    large = row_args(variant)
    lanes = 32 * variant.num_warps
    tile = variant.constexpr("BLOCK_M") * variant.constexpr("BLOCK_N")
    size = {arg: _BYTES[variant.dtype(arg)] for arg in large}
    counts: dict[str, dict[str, float]] = {"load": {}, "store": {}}
    for kind, arg, width_ in usage.accesses:
        if arg in size:
            counts[kind][arg] = counts[kind].get(arg, 0) + width_ * lanes / (tile * size[arg])
    reads, writes = counts["load"], counts["store"]
    resident = programs_per_sm(variant, usage)
    touched = sum(size[a] for a in set(reads) | set(writes))
    twice = any(n > 1 for n in reads.values())
    working_set = (rows_in_progress(resident, variant.constexpr("BLOCK_M"), max(widths), touched)
                   if twice else 0)
    on_chip = l2_holds(working_set)
    off_chip = {a: (1 if on_chip else n) for a, n in reads.items()}
    moved = sum(off_chip[a] * size[a] for a in reads) + sum(n * size[a] for a, n in writes.items())
    floor = sum(size[a] for a in reads) + sum(size[a] for a in writes)
    batches = [sum(usage.accesses[i][2] for i in batch if usage.accesses[i][1] in size)
               for batch in usage.batches]
    active = min(active_share(width, variant.constexpr("BLOCK_N")) for width in widths)
    batches = [int(b * active) for b in batches if b]
    access_widths = [w for _, arg, w in usage.accesses if arg in size]
    return Traffic(reads=reads, writes=writes, off_chip_reads=off_chip,
                   bytes_over_floor=moved / floor if floor else 1.0,
                   vector_bytes=min(access_widths, default=0),
                   warp_bytes=32 * min(batches, default=0),
                   programs_per_sm=resident, warps=variant.num_warps, working_set=working_set)

"""Which implementation runs a call (the Triton kernels or the PyTorch reference: choice.py for
`auto` under torch.compile), and what the kernel files share: the optional triton import, whether
triton interprets the kernels, tile sizes, and the device figures they are sized for."""

import functools
import math

import torch
from torch import Tensor

from . import choice
from .errors import KernelError

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend needs no triton
    triton = tl = None

BACKENDS = ("auto", "triton", "torch")
# The fix every backend error names (a framework wraps it with the name of its own option).
_USE_OTHER = "Use backend 'auto' or 'torch'"

if triton is not None:

    @triton.jit
    def _probe():
        pass

    # TRITON_INTERPRET is read when @triton.jit runs, i.e. when this package is first imported, so
    # the answer holds for every kernel of the package.
    INTERPRETED = not isinstance(_probe, triton.runtime.JITFunction)
else:
    INTERPRETED = False


def check_backend(backend: str, device_type: str) -> None:
    """Raise KernelError unless `backend` is a known name that can run on tensors of `device_type`
    ("cuda", "cpu", ...; "cuda:1" counts as "cuda"). Whether a call fits the kernels (sizes, dtypes)
    is checked per call; this check needs no tensor, so a framework can validate its config before
    any work."""
    if backend not in BACKENDS:
        raise KernelError(f"unknown kernels backend {backend!r}.",
                          f"Use one of {', '.join(BACKENDS)}.")
    if backend != "triton":
        return
    if triton is None:
        raise KernelError("kernels backend 'triton' needs the triton package.",
                          f"Install triton, or {_USE_OTHER}.")
    device_type = device_type.split(":")[0]
    if device_type != "cuda" and not INTERPRETED:
        raise KernelError(f"kernels backend 'triton' needs CUDA tensors, got {device_type}.",
                          f"{_USE_OTHER}, or set TRITON_INTERPRET=1 before importing "
                          "scalevec_kernels to run triton's interpreter.")


def use_triton(backend: str, x: Tensor, misfit: str | None, device_type: str | None = None,
               shape: tuple | None = None) -> bool:
    """Whether a call on x runs the kernels: `auto` takes them when they can, except inside
    torch.compile where the latest measurements on a GPU found torch.compile's code of the reference
    faster for the op and `shape` (choice.faster's arguments); `triton` insists on them. `misfit`
    says why the call does not fit the kernels, None when it does. `device_type` decides as if x
    were on that device (the capture of dev/kernel_tools/aot.py answers for CUDA on CPU tensors)."""
    device_type = (device_type or x.device.type).split(":")[0]
    check_backend(backend, device_type)
    if backend == "torch":
        return False
    if backend == "auto":
        if misfit is not None or device_type != "cuda" or triton is None:
            return False
        return (shape is None or not torch.compiler.is_compiling()
                or choice.faster(*shape) == "fused")
    if misfit is not None:
        raise KernelError(misfit, f"{_USE_OTHER}.")
    return True


def tile(n: int, budget: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for tiles of whole rows of n features holding about `budget`
    elements."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(64, budget // block_n))
    return block_m, block_n, min(16, max(1, block_m * block_n // 512))


def chunked_tile(n: int, budget: int, per_thread: int,
                 chunk: int | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of tiles of at most `budget` elements, `per_thread` a thread:
    whole rows when they fit (several rows of narrow ones), else chunks of `chunk`
    (default: `budget`) features that the kernel walks twice, the second time from L2."""
    block_n = min(triton.next_power_of_2(n), chunk or budget, budget)
    block_m = max(1, min(64, budget // block_n))
    return block_m, block_n, min(MAX_WARPS, max(1, block_m * block_n // (32 * per_thread)))


def active_share(n: int, block_n: int) -> float:
    """The share of a row's tile lanes that its n features keep busy: past the row's end (a row
    narrower than its tile, or a partial last chunk) lanes fetch nothing, yet each pass over a chunk
    takes a memory latency all the same."""
    return n / (triton.cdiv(n, block_n) * block_n)


# a few dozen candidate tiles: 0.1 ms of Python, once per shape instead of per call
@functools.cache
def backward_tile(n: int, row_bytes: int, touched: int, widest: int,
                  chunk: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, elements a thread) of a backward on rows of n features, which
    it walks in chunks twice (the reduction, then the gradients) when a thread holds more than
    BACKWARD_PER_THREAD or the row is wider than a tile. The fewest elements a thread
    (BACKWARD_PER_THREAD, twice or four times that, up to `widest`: what the kernel holds within
    MAX_REGISTERS without a spill), then the widest chunk, that keep IN_FLIGHT_NEEDED in flight on
    an SM of WARPS_PER_SM warps with the large tensors the first pass loads
    (`row_bytes` per element), counting only the lanes the row keeps busy, and whose rows in
    progress on the device fit half the L2 between a chunk's two reads (`touched` bytes per element:
    every large tensor read or written), so that the second read stays on chip. A narrower chunk can
    waste fewer lanes on a row that is no power of two. Where none does, the fewest elements a
    thread that keep enough in flight at the widest chunk."""
    # (tile, enough in flight, fits the L2, widest chunk): fewest elements a thread first
    candidates = []
    for per_thread in (BACKWARD_PER_THREAD, 2 * BACKWARD_PER_THREAD, 4 * BACKWARD_PER_THREAD):
        if per_thread > widest:
            break
        budget = MAX_WARPS * 32 * per_thread
        block_n = min(triton.next_power_of_2(n), chunk or budget, budget)
        first = True
        # narrower chunks, until a tile has its most rows (64)
        while first or budget // block_n <= 64:
            block_m, _, warps = chunked_tile(n, budget, per_thread, block_n)
            enough = (row_bytes * per_thread * 32 * WARPS_PER_SM * active_share(n, block_n)
                      >= IN_FLIGHT_NEEDED)
            fits = l2_holds(rows_in_progress(WARPS_PER_SM // warps, block_m, n, touched))
            candidates.append(((block_m, block_n, warps, per_thread), enough, fits, first))
            first, block_n = False, block_n // 2
    for tile_, enough, fits, _ in candidates:
        if enough and fits:
            return tile_
    for tile_, enough, _, first in candidates:
        if first and enough:
            return tile_
    return [tile_ for tile_, *_, first in candidates if first][-1]


def forward_registers(n: int, block_m: int, block_n: int, num_warps: int, row_bytes: int,
                      least: int) -> int:
    """The register cap (maxnreg) of a forward launch, whose programs of `num_warps` warps each load
    a tile of BLOCK_M x BLOCK_N elements of `row_bytes` bytes (its large tensors together) before
    they first wait. A forward's grid gives each SM many programs, so registers decide how many
    reside; on rows narrower than their tile the idle lanes hold registers too and would crowd a
    program out, so there the cap is what leaves room for the programs that keep IN_FLIGHT_NEEDED in
    flight on an SM (at least MIN_PROGRAMS_PER_SM), counting only the lanes the row keeps busy, and
    at least `least`, what the kernel needs on such a tile without a spill. Rows that fill their
    tile keep MAX_REGISTERS."""
    share = active_share(n, block_n)
    if share == 1:
        return MAX_REGISTERS
    programs = max(MIN_PROGRAMS_PER_SM,
                   math.ceil(IN_FLIGHT_NEEDED / (block_m * block_n * row_bytes * share)))
    per_thread = REGISTERS_PER_SM // (programs * num_warps * 32)
    return max(least, min(MAX_REGISTERS, per_thread // REGISTER_UNIT * REGISTER_UNIT))


# Warps per program at most: 8, so that an SM of WARPS_PER_SM warps holds two programs and one loads
# while the other reduces and stores. 8 elements a thread keep the K fp32 accumulators and the
# working rows of a backward within MAX_REGISTERS.
MAX_WARPS, BACKWARD_PER_THREAD = 8, 8
# The warps per SM a backward's persistent grid fills: at <= 128 registers a thread, 16 warps fit in
# an SM's 65536 registers. Every launch passes the cap to ptxas (maxnreg): without one, ptxas
# spilled a register now and then with registers to spare; tests/kernels/test_compile_ahead.py
# checks that no variant the presets launch spills under it.
WARPS_PER_SM, MAX_REGISTERS = 16, 128
# An SM's registers, handed to warps in units of REGISTER_UNIT a thread (256 a warp); at least two
# resident programs, so that one loads while another reduces and stores.
REGISTERS_PER_SM, REGISTER_UNIT, MIN_PROGRAMS_PER_SM = 65536, 8, 2
# The device the tiles are sized for, an H200 (the H100 SXM needs less): Little's law asks each SM
# to keep bandwidth x latency / SMs bytes in flight. 4.8 TB/s: H200's HBM3e (NVIDIA's datasheet;
# 3.35 TB/s on an H100 SXM); 800 ns: the upper end of 600-800 ns for a loaded HBM access on Hopper;
# 132 SMs.
SMS, BANDWIDTH, LATENCY = 132, 4.8e12, 800e-9
L2_BYTES = 50 * 2**20  # H100 SXM and H200
IN_FLIGHT_NEEDED = math.ceil(BANDWIDTH * LATENCY / SMS)


def rows_in_progress(programs_per_sm: int, block_m: int, n: int, row_bytes: int) -> int:
    """Bytes of the rows the whole device has in progress: programs_per_sm programs on every SM,
    each on block_m rows of n features of `row_bytes` bytes (every large tensor it reads or
    writes)."""
    return SMS * programs_per_sm * block_m * n * row_bytes


def l2_holds(working_set: int) -> bool:
    """Whether rows read twice stay in the L2 between the reads: half of it, the rest being other
    traffic's."""
    return working_set <= L2_BYTES // 2


def pointer_slots(tensors: list, fill, slots: int) -> list:
    """A kernel's `slots` pointer arguments from `tensors` (None where a slot is unused, and missing
    ones at the end) pointing the unused ones at `fill`, which the kernel never touches through
    them."""
    return [fill if t is None else t for t in tensors] + [fill] * (slots - len(tensors))


def resident_programs(device: torch.device, num_warps: int) -> int:
    """Programs of num_warps warps in a backward's persistent grid: as many as the device holds at
    once (one wave); 3 off-GPU (a few, uneven on purpose, so that the CPU tests give programs
    several tiles)."""
    sms = sm_count(device)
    return sms * max(1, WARPS_PER_SM // num_warps) if sms else 3


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SMs; 0 off-GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0

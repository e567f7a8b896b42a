"""Which implementation runs a call (the Triton kernels or the PyTorch reference), and what the kernel
files share: the optional triton import, whether triton interprets the kernels, and tile sizes."""

import functools

import torch
from torch import Tensor

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

    # TRITON_INTERPRET is read when @triton.jit runs, i.e. when this package is first imported, so the
    # answer holds for every kernel of the package.
    INTERPRETED = not isinstance(_probe, triton.runtime.JITFunction)
else:
    INTERPRETED = False


def check_backend(backend: str, device_type: str) -> None:
    """Raise KernelError unless `backend` is a known name that can run on tensors of `device_type`
    ("cuda", "cpu", ...; "cuda:1" counts as "cuda"). Whether a call fits the kernels (sizes, dtypes) is
    checked per call; this check needs no tensor, so a framework can validate its config before any work."""
    if backend not in BACKENDS:
        raise KernelError(f"unknown kernels backend {backend!r}.", f"Use one of {', '.join(BACKENDS)}.")
    if backend != "triton":
        return
    if triton is None:
        raise KernelError("kernels backend 'triton' needs the triton package.", f"Install triton, or {_USE_OTHER}.")
    device_type = device_type.split(":")[0]
    if device_type != "cuda" and not INTERPRETED:
        raise KernelError(f"kernels backend 'triton' needs CUDA tensors, got {device_type}.",
                          f"{_USE_OTHER}, or set TRITON_INTERPRET=1 before importing scalevec_kernels to run "
                          "triton's interpreter.")


def use_triton(backend: str, x: Tensor, misfit: str | None, device_type: str | None = None) -> bool:
    """Whether a call on x runs the kernels: `auto` takes them when they can, `triton` insists on them.
    `misfit` says why the call does not fit the kernels, None when it does. `device_type` decides as if x
    were on that device (aot.capture answers for CUDA on CPU tensors)."""
    device_type = (device_type or x.device.type).split(":")[0]
    check_backend(backend, device_type)
    if backend == "torch":
        return False
    if backend == "auto":
        return misfit is None and device_type == "cuda" and triton is not None
    if misfit is not None:
        raise KernelError(misfit, f"{_USE_OTHER}.")
    return True


def tile(n: int, budget: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for tiles of whole rows of n features holding about `budget` elements."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(64, budget // block_n))
    return block_m, block_n, min(16, max(1, block_m * block_n // 512))


def backward_tile(n: int, budget: int, chunk: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of a backward: whole rows when they fit in `chunk` features, else
    rows walked in chunks of `chunk` features. Each thread holds BACKWARD_PER_THREAD elements of a tile,
    so that the K fp32 scale-gradient accumulators and the working rows fit in 128 registers a thread,
    which lets 16 warps stay resident per SM (see resident_programs)."""
    block_n = min(triton.next_power_of_2(n), chunk)
    block_m = max(1, min(64, budget // block_n))
    return block_m, block_n, min(MAX_WARPS, max(1, block_m * block_n // (32 * BACKWARD_PER_THREAD)))


MAX_WARPS, BACKWARD_PER_THREAD = 16, 8
# The warps per SM a backward's persistent grid fills: at <= 128 registers a thread, 16 warps fit in an
# SM's 65536 registers. Every launch passes the cap to ptxas (maxnreg): without one, ptxas spilled a
# register now and then with registers to spare; tests/kernels/test_compile_ahead.py checks that no
# variant the presets launch spills under it.
WARPS_PER_SM, MAX_REGISTERS = 16, 128


def resident_programs(device: torch.device, num_warps: int) -> int:
    """Programs of num_warps warps in a backward's persistent grid: as many as the device holds at once
    (one wave); 3 off-GPU (a few, uneven on purpose, so that the CPU tests give programs several tiles)."""
    sms = sm_count(device)
    return sms * max(1, WARPS_PER_SM // num_warps) if sms else 3


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SMs; 0 off-GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0

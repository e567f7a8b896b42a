"""dev/kernel_tools/aot.py: a compiled variant's occupancy and its limits on each architecture, and
a spilling tile caught by the check every preset's variant passes
(tests/kernels/test_compile_ahead.py)."""

import pytest

from dev.kernel_tools import aot
from scalevec_kernels import backend, rms_norm
from tests.support.kernels import rms_norm_variants

pytest.importorskip("triton")
if backend.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: these tests compile the kernels", allow_module_level=True)
CC = 90


def test_a_spilling_tile_is_caught(monkeypatch):
    """The tiling before issue 27: whole rows of 8192 in one tile of 16 warps (16 elements a thread)
    holding K = 4 accumulators spills, and the check says so."""
    monkeypatch.setattr(rms_norm, "_BWD_TILE", 8192)
    monkeypatch.setattr(backend, "MAX_WARPS", 16)
    monkeypatch.setattr(backend, "BACKWARD_PER_THREAD", 16)
    (bwd,) = [v for v in rms_norm_variants(8192, 4) if v.kernel == "rms_norm._bwd_kernel"]
    assert dict(bwd.constexprs)["BLOCK_N"] == 8192 and bwd.num_warps == 16
    usage = aot.compile_variant(bwd, CC, code=False)
    assert usage.spill_bytes > 0
    assert usage.problems() == [f"spills {usage.spill_bytes} B per thread to local memory (sm_90)"]


def test_occupancy_and_shared_memory_limits():
    """Occupancy from registers (65536 per SM, given to warps in units of 256) and shared memory."""
    full = aot.Usage(cc=90, registers=128, spill_bytes=0, shared_bytes=16384)
    assert full.blocks_per_sm(16) == 1 and full.occupancy(16) == 0.25
    assert aot.Usage(90, 64, 0, 0).occupancy(16) == 0.5
    # 41 registers round up to 48 a thread: 1536 a warp, 65536 // (1536 * 8) = 5 blocks of 8 warps
    assert aot.Usage(90, 41, 0, 0).blocks_per_sm(8) == 5
    assert aot.Usage(90, 32, 0, 100 * 1024).blocks_per_sm(4) == 2  # 228 KB of shared memory an SM
    assert aot.Usage(90, 32, 0, 200 * 1024).problems() == []
    assert aot.Usage(80, 32, 0, 200 * 1024).problems() == [
        f"needs {200 * 1024} B of shared memory, over sm_80's {163 * 1024} B per block"]

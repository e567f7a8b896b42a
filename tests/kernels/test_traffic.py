"""The memory traffic of every kernel variant the GPU-sized presets launch in bf16 (their recipes train
under bf16 autocast), proven from its compiled code (SASS for sm_90) and its launch configuration
(scalevec_kernels.traffic), against stated bounds:

- every large tensor leaves the chip once: bytes per call at their floor (a chunked row's second read
  is served by L2);
- an SM keeps at least backend.IN_FLIGHT_NEEDED bytes in flight (an H200's bandwidth x latency / SMs)
  with at least two programs resident, except the variants KNOWN_SHORT lists with what they keep: the
  list must stay true both ways (a listed variant that meets the bound fails the test too, so that it
  leaves the list).

The captured launches and the compiled usage are cached as in test_compile_ahead.py.
"""


import pytest
import torch

from scalevec_kernels import aot, backend, swiglu_norm, traffic
from scalevec_kernels.backend import INTERPRETED
from tests.helpers import REPO, load_script

pytest.importorskip("triton")
if INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: these tests compile the kernels", allow_module_level=True)
kernel_table = load_script(REPO / "scripts" / "kernel_table.py")
swiglu_kernels = __import__("scalevec_kernels.swiglu_norm", fromlist=["_"])
CC = 90
GPU_PRESET = kernel_table.GPU_PRESET
# Variants below the in-flight bound today, by (kernel, tile, flags, dtypes) with the bytes an SM keeps in
# flight (63-88% of the bound): rows of 2560 in tiles of 4096 (dense-2b: 5/8 of the lanes fetch), of 384
# in 512 (moe-0.5b), and the chunked RMSNorm backward's first pass, which reads x and the K output
# gradients but not the residual's (docs/benchmarks.md, "Kernels proven on the CPU").
KNOWN_SHORT: dict[tuple[str, str, str, str], int] = {
    ('rms_norm bwd', '1x2048 chunked', 'K=2 scaled=11 residual', 'bf16/fp32'): 24576,  # dense-0.5b ... dense-2b
    ('rms_norm bwd', '1x4096 chunked', 'K=1 scaled=0', 'bf16'): 20480,  # dense-2b
    ('rms_norm bwd', '1x4096 chunked', 'K=1 scaled=0 residual', 'bf16'): 20480,  # dense-2b
    ('rms_norm bwd', '1x4096 chunked', 'K=1 scaled=1', 'bf16/fp32'): 20480,  # dense-2b
    ('rms_norm bwd', '1x4096 chunked', 'K=1 scaled=1 residual', 'bf16/fp32'): 20480,  # dense-2b
    ('rms_norm bwd', '2x1024 chunked', 'K=2 scaled=1 residual', 'bf16/fp32'): 24576,  # moe-0.5b, moe-2b
    ('rms_norm bwd', '2x1024 chunked', 'K=2 scaled=11 residual', 'bf16/fp32'): 18432,  # dense-0.12b
    ('rms_norm fwd', '1x4096', 'K=3 scaled=111', 'bf16/fp32'): 25600,  # dense-2b
    ('swiglu_norm fwd', '8x512', 'scaled=11 per_expert=11', 'bf16/fp32'): 24576,  # moe-0.5b
}


@pytest.fixture(scope="module")
def audited():
    users, widths = kernel_table.cached_preset_launches()
    gpu = [v for v, presets in users.items() if any(GPU_PRESET.search(p) for p in presets)
           and v.dtype(traffic.row_args(v)[0 if "rms" in v.kernel else 1]) == "bf16"]
    usage = kernel_table.compile_all(gpu, [CC])
    return {v: (max(widths[v]), traffic.traffic(v, usage[v, CC], max(widths[v]))) for v in gpu}


def test_every_large_tensor_leaves_the_chip_once(audited):
    over = {kernel_table.describe(v): (t.off_chip_reads, t.writes) for v, (_, t) in audited.items()
            if t.bytes_over_floor != 1.0}
    assert not over, over
    # dense-1b's FFN (8192 wide): both SwiGLU kernels read their rows twice, the second time from L2
    wide = [t for v, (width, t) in audited.items() if "swiglu" in v.kernel and width == 8192]
    assert len(wide) == 2 and all(max(t.reads.values()) == 2 and 0 < t.working_set <= traffic.L2_BYTES // 2
                                  for t in wide)


def test_each_sm_keeps_enough_in_flight(audited):
    short = {kernel_table.describe(v): t.in_flight for v, (_, t) in audited.items() if t.problems()}
    assert short == KNOWN_SHORT
    assert all(t.vector_bytes == 16 for _, t in audited.values())  # 128-bit loads and stores of every row


def _swiglu_variants(f: int, dtype: torch.dtype) -> list[aot.Variant]:
    with aot.capture() as captured:
        g, u = (torch.randn(16, f, dtype=dtype, requires_grad=True) for _ in range(2))
        scales = [torch.ones(f, requires_grad=True) for _ in range(2)]
        out = swiglu_norm(g, u, *scales, 1e-6, backend="triton")
        torch.autograd.grad(out, [g, u, *scales], torch.ones_like(out))
    return captured.variants


def test_a_second_pass_the_l2_cannot_hold_is_caught():
    """fp32 rows of 16384 features walked twice by the forward: what the device reads between a chunk's two
    reads is over half the L2, so the second read leaves the chip and the call moves more than its floor."""
    (fwd,) = [v for v in _swiglu_variants(16384, torch.float32) if v.kernel == "swiglu_norm._fwd_kernel"]
    assert fwd.constexpr("CHUNKED")
    t = traffic.traffic(fwd, aot.compile_variant(fwd, CC), 16384)
    assert t.working_set > traffic.L2_BYTES // 2 and t.bytes_over_floor > 1.5
    assert "reads G 2 times off the chip" in t.problems()


def test_a_launch_with_too_little_in_flight_is_caught(monkeypatch):
    """The SwiGLU backward of dense-1b at 4 elements a thread: a quarter of what its loads keep in flight."""
    monkeypatch.setattr(backend, "BACKWARD_PER_THREAD", 2)
    (bwd,) = [v for v in _swiglu_variants(8192, torch.bfloat16) if v.kernel == "swiglu_norm._bwd_kernel"]
    t = traffic.traffic(bwd, aot.compile_variant(bwd, CC), 8192)
    assert t.in_flight < backend.IN_FLIGHT_NEEDED
    want = f"keeps {t.in_flight} B in flight per SM, under the {backend.IN_FLIGHT_NEEDED} B an H200 needs"
    assert want in t.problems()

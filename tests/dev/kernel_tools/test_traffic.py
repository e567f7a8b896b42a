"""dev/kernel_tools/traffic.py catches what its bounds are for: a second pass over rows that the L2
cannot hold, and a launch with too little in flight (the bounds every preset's bf16 row kernel
meets: tests/kernels/test_compile_ahead.py)."""

import importlib

import pytest
import torch

from dev.kernel_tools import aot, traffic
from scalevec_kernels import backend, swiglu_norm
from scalevec_train.config import compose_config
from tests.support.helpers import REPO, load_script

pytest.importorskip("triton")
if backend.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: these tests compile the kernels", allow_module_level=True)
kernel_table = load_script(REPO / "dev" / "kernel_table.py")
CC = 90


def _launched_by(preset: str, strategy: str) -> list[aot.Variant]:
    """The variants `preset` launches under `strategy` (one of kernel_table.STRATEGIES), captured as
    the presets' table captures them: one preset and strategy, not every preset's launches."""
    model = compose_config([f"model={preset}", *kernel_table.CHEAP], 1).model
    scale = compose_config(["model=moe-tiny", *kernel_table.STRATEGIES[strategy],
                            *kernel_table.CHEAP], 1).scale
    return kernel_table._capture_model(model, scale).variants


def _swiglu_variants(f: int, dtype: torch.dtype) -> list[aot.Variant]:
    with aot.capture() as captured:
        g, u = (torch.randn(16, f, dtype=dtype, requires_grad=True) for _ in range(2))
        scales = [torch.ones(f, requires_grad=True) for _ in range(2)]
        out = swiglu_norm(g, u, *scales, 1e-6, backend="triton")
        torch.autograd.grad(out, [g, u, *scales], torch.ones_like(out))
    return captured.variants


def test_a_second_pass_the_l2_cannot_hold_is_caught():
    """fp32 rows of 16384 features (the library's widest) walked twice by the forward, which
    launches the binary dense-1b's fp32 rows of 8192 do (under unified, whose gate and up are
    normalized): what the device reads between a chunk's two reads is over half the L2, so the
    second read leaves the chip and the call moves more than its floor."""
    (fwd,) = [v for v in _swiglu_variants(16384, torch.float32)
              if v.kernel == "swiglu_norm._fwd_kernel"]
    assert fwd.constexpr("CHUNKED") and fwd in _launched_by("dense-1b", "unified")
    t = traffic.traffic(fwd, aot.compile_variant(fwd, CC), {16384})  # its own SASS, fp32's
    assert t.working_set > backend.L2_BYTES // 2 and t.bytes_over_floor > 1.5
    assert "reads G 2 times off the chip" in t.problems()


def test_a_launch_with_too_little_in_flight_is_caught(monkeypatch):
    """The SwiGLU backward of dense-1b at 4 elements a thread: a quarter of what its loads keep in
    flight."""
    monkeypatch.setattr(importlib.import_module("scalevec_kernels.swiglu_norm"), "backward_tile",
                        lambda *_: (1, 1024, 8, 4))
    (bwd,) = [v for v in _swiglu_variants(8192, torch.bfloat16)
              if v.kernel == "swiglu_norm._bwd_kernel"]
    t = traffic.traffic(bwd, aot.compile_variant(bwd, CC), {8192})
    assert t.in_flight < backend.IN_FLIGHT_NEEDED
    want = (f"keeps {t.in_flight} B in flight per SM, under the {backend.IN_FLIGHT_NEEDED} B an "
            "H200 needs")
    assert want in t.problems()

"""Backend choice (scalevec_kernels.backend): names, devices, and a missing triton."""

import os
import subprocess
import sys

import pytest
import torch

from scalevec_kernels import BACKENDS, KernelError, check_backend, rms_norm_scales
from scalevec_kernels.backend import INTERPRETED
from tests.support.kernels import EPS


def test_check_backend_names_and_devices():
    for backend in BACKENDS:
        check_backend(backend, "cuda")
    for backend in ("auto", "torch"):
        check_backend(backend, "cpu")
    with pytest.raises(KernelError, match="unknown kernels backend 'cuda'") as info:
        check_backend("cuda", "cuda")
    assert "auto, triton, torch" in info.value.fix


@pytest.mark.skipif(INTERPRETED, reason="under TRITON_INTERPRET=1 the kernels do run on CPU")
def test_triton_backend_on_cpu_says_how_to_fix():
    pytest.importorskip("triton")
    with pytest.raises(KernelError, match="backend 'auto' or 'torch'"):
        check_backend("triton", "cpu")
    check_backend("triton", "cuda:1")
    with pytest.raises(KernelError, match="backend 'auto' or 'torch'"):
        rms_norm_scales(torch.randn(3, 8), [None], EPS, backend="triton")


def test_works_without_triton():
    """Without triton the package imports, runs the torch path and says why `triton` cannot run."""
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` fail
import torch
from scalevec_kernels import KernelError, check_backend, rms_norm_scales, swiglu_norm
x = torch.randn(3, 8)
(y,) = rms_norm_scales(x, None, 1e-6)
assert torch.allclose(y, torch.nn.functional.rms_norm(x, (8,), eps=1e-6))
assert swiglu_norm(x, x, None, None, 1e-6).shape == x.shape
check_backend("auto", "cuda")
for run in (lambda: rms_norm_scales(x, None, 1e-6, backend="triton"),
            lambda: check_backend("triton", "cuda")):
    try:
        run()
    except KernelError as e:
        assert "needs the triton package" in str(e)
    else:
        raise AssertionError("backend='triton' ran without triton")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]


def test_auto_picks_by_the_latest_visits_measurements():
    """choice.pick against the table in measured/ (written in the test from the first visit's
    files)."""
    from scalevec_kernels import choice

    table = choice.TABLE
    assert ((table["device"], table["date"], table["triton"])
            == ("NVIDIA H200", "2026-11-26", "3.6.0"))
    # measured: compile faster for the SwiGLU at dense-1b's width (1377.7 against 1534.8 us), shared
    # scales or per expert; the fused RMSNorm faster with K = 3 at 1024 (113.2 against 157.4 us)
    assert choice.pick("swiglu_norm", 8192)[0] == "compile"
    impl, why = choice.pick("swiglu_norm", 8192, experts=64)
    assert impl == "compile" and why.startswith("measured: fused 2426.5 us, compile 1371.1 us "
                                                "(device time")
    assert choice.pick("rms_norm", 1024, 3) == ("fused", choice.pick("rms_norm", 1024, 3)[1])
    # dense-2b's 2560 stands on 2048's wall-time measurement; moe-2b's expert width 512 on nothing
    impl, why = choice.pick("rms_norm", 2560, 1)
    assert impl == "compile" and why.startswith("nearest measured width 2048: fused 721.4 us")
    impl, why = choice.pick("swiglu_norm", 512, experts=64)
    assert impl == "fused" and why.startswith("not measured (no width within 2x of 512 "
                                              "with per-expert scales)")
    assert choice.pick("rms_norm", 64, 1)[0] == "fused"  # a head's 64 features: not measured


def test_auto_decides_inside_a_real_compile_by_the_measurements():
    """torch.compile traces auto's decision to a constant (fullgraph: a graph break is an error):
    a measured shape of each pick, one standing on a nearest width, one measured nowhere."""
    pytest.importorskip("triton")
    from scalevec_kernels import backend

    shapes = {("swiglu_norm", 8192, 1, 0): False, ("rms_norm", 1024, 3, 0): True,
              ("rms_norm", 2560, 1, 0): False, ("swiglu_norm", 512, 1, 64): True}
    for shape, fused in shapes.items():
        torch._dynamo.reset()  # each shape traced afresh, as a model's first step is

        @torch.compile(fullgraph=True, backend="eager")
        def step(x, shape=shape):
            return x + 1 if backend.use_triton("auto", x, None, "cuda", shape) else x - 1
        assert step(torch.zeros(2)).tolist() == ([1.0, 1.0] if fused else [-1.0, -1.0]), shape


def test_auto_takes_the_reference_inside_compile_where_compile_measured_faster(monkeypatch):
    pytest.importorskip("triton")
    from scalevec_kernels import backend

    x = torch.empty(2, 8192)
    swiglu, rms3 = ("swiglu_norm", 8192, 1, 0), ("rms_norm", 1024, 3)
    assert backend.use_triton("auto", x, None, "cuda", swiglu)  # eager: the fused kernels
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not backend.use_triton("auto", x, None, "cuda", swiglu)
    assert backend.use_triton("auto", x, None, "cuda", rms3)
    assert backend.use_triton("triton", x, None, "cuda", swiglu)  # triton insists
    assert not backend.use_triton("auto", x, None, "cpu", rms3)

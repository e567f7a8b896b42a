"""Backend choice (scalevec_kernels.backend): names, devices, and a missing triton."""

import os
import subprocess
import sys

import pytest
import torch

from scalevec_kernels import BACKENDS, KernelError, check_backend, rms_norm_scales
from scalevec_kernels.backend import INTERPRETED
from tests.kernels.helpers import EPS


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
for run in (lambda: rms_norm_scales(x, None, 1e-6, backend="triton"), lambda: check_backend("triton", "cuda")):
    try:
        run()
    except KernelError as e:
        assert "needs the triton package" in str(e)
    else:
        raise AssertionError("backend='triton' ran without triton")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]

"""What the kernel tests share: scale parameters built the model's way, tolerances, and the child process
that runs a file's test_interp_ tests under triton's interpreter.

Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when scalevec_kernels is first
imported, which in a full test session has happened long before a kernel test file runs. So each kernel
test file runs itself again in a child process with TRITON_INTERPRET=1 (run_interpreted), and defines
its test_interp_ tests only in such a process (`TRITON_INTERPRET=1 pytest tests/kernels/FILE` runs them
directly).
"""

import os
import subprocess
import sys

import pytest
import torch

EPS = 1e-6


def grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream)


def scale_params(shape, param: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Leaf parameters of a scale site: [s] (plain) or [magnitude, alpha] (the spec's `or` / `er`)."""
    alpha = (1 + 0.5 * torch.randn(shape, generator=gen)).requires_grad_()
    if param == "plain":
        return [alpha]
    return [(0.2 * torch.randn(1, generator=gen)).requires_grad_(), alpha]


def scale(params: list[torch.Tensor], param: str) -> torch.Tensor:
    """s from its parameters with ordinary torch ops: beta * alpha / rms(alpha), beta = 1 + m or exp(m)."""
    if param == "plain":
        return params[0]
    magnitude, alpha = params
    direction = alpha * torch.rsqrt(alpha.square().mean())
    return (1 + magnitude if param == "or" else magnitude.exp()) * direction


def assert_scale_grad_close(got, want, m):
    """The issue's bound: within 5e-6 * sqrt(M) of the reference, relative to its largest entry."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 5e-6 * m ** 0.5 * want.abs().max().item(), (err, want.abs().max().item())


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def run_interpreted(test_file: str) -> None:
    """Run the test_interp_ tests of test_file in a child process whose triton interprets the kernels."""
    triton = pytest.importorskip("triton")
    import numpy

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip("triton < 3.7 cannot interpret loops under numpy >= 2.4: use triton >= 3.7 or numpy < 2.4")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_", test_file]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    # Exit code 5 (nothing collected) would mean the child's kernels were not interpreted either.
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-4000:]

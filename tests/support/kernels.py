"""What the kernel tests share: scale sites built the model's way, tolerances, the child process
that runs a file's test_interp_ tests under triton's interpreter, and launches captured without
running them (dev/kernel_tools/aot.py).

Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when scalevec_kernels is
first imported, which in a full test session has happened long before a kernel test file runs. So
a test file defines its test_interp_ tests only under TRITON_INTERPRET=1, and
tests/kernels/test_interpreted.py runs those of every file in one child process with it set
(run_interpreted: one start of Python, torch and triton for all of them; `TRITON_INTERPRET=1 pytest
FILE` runs one file's directly).
"""

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scalevec_train.model.strategies import ScaleSite

EPS = 1e-6
TESTS = Path(__file__).resolve().parents[1]


def grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream)


def scale_site(shape, param: str, gen: torch.Generator) -> ScaleSite:
    """A scale site built as the model builds it (ScaleSite: s = p for plain; beta * alpha /
    rms(alpha) for `or` and exp(b) * alpha / rms(alpha) for `er`, with one magnitude and rms per row
    of a 2-D site), its parameters moved off their initial values so that each one matters."""
    site = ScaleSite(shape if isinstance(shape, tuple) else (shape,), "input", param)
    with torch.no_grad():
        for name, p in site.named_parameters():
            p.add_((0.5 if name in ("scale", "alpha") else 0.2)
                   * torch.randn(p.shape, generator=gen))
    return site


def assert_scale_grad_close(got, want, m):
    """The issue's bound: within 5e-6 * sqrt(M) of the reference, relative to its largest entry."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 5e-6 * m ** 0.5 * want.abs().max().item(), (err, want.abs().max().item())


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def interpreted_files() -> list[Path]:
    """The test files that define test_interp_ tests, found by their source."""
    return sorted(p for p in TESTS.rglob("test_*.py") if "def test_interp_" in p.read_text())


def run_interpreted(test_files: list[Path]) -> None:
    """Run the test_interp_ tests of test_files in one child process whose triton interprets the
    kernels."""
    triton = pytest.importorskip("triton")
    import numpy

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip("triton < 3.7 cannot interpret loops under numpy >= 2.4: use triton >= 3.7 or "
                    "numpy < 2.4")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_",
               *map(str, test_files)]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    # Exit code 5 (nothing collected) would mean the child's kernels were not interpreted either.
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-4000:]


def host_ops(call) -> tuple[collections.Counter, list[str]]:
    """The torch ops `call` dispatches on the host, by name (an op's own inner ops, e.g. zeros'
    fill_, not counted again), and the kernel launches it issues, in order: `call` runs under
    aot.capture (the kernel path on CPU tensors, each launch recorded instead of run) and torch's
    profiler."""
    from torch.profiler import ProfilerActivity, profile

    from dev.kernel_tools import aot

    with aot.capture() as launches, profile(activities=[ProfilerActivity.CPU]) as prof:
        call()

    def inside_op(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return parent is not None

    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                              and not inside_op(e))
    return ops, launches.calls


def rms_norm_variants(n: int, k: int) -> list:
    """The compile variants (aot.Variant) of K outputs with a residual at width n in bf16, forward
    and backward, captured on CPU tensors."""
    from dev.kernel_tools import aot
    from scalevec_kernels import rms_norm_scales

    with aot.capture() as captured:
        x, r = (torch.randn(16, n, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        scales = [torch.ones(n, requires_grad=True) for _ in range(k)]
        outs = rms_norm_scales(x, scales, 1e-6, residual=r, backend="triton")
        torch.autograd.grad(outs, [x, r, *scales], [torch.ones_like(o) for o in outs])
    return captured.variants

"""The fused RMSNorm+scale kernels (scalevec_kernels) against plain PyTorch, on CPU in fp32.

The Triton kernels run in triton's CPU interpreter. Triton reads TRITON_INTERPRET when @triton.jit
decorates a kernel, i.e. when scalevec_kernels is first imported, which in a full test session has
happened long before this file. So test_triton_kernels_in_interpreter runs this file again in a child
process with TRITON_INTERPRET=1, and the test_interp_ tests are defined only in such a process
(`TRITON_INTERPRET=1 pytest tests/test_kernels.py` runs them directly).
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scalevec_kernels import (
    head_rms_norm,
    head_rms_norm_reference,
    rms_norm_scales,
)
from scalevec_kernels.rms_norm import _INTERPRETED
from scalevec_train.errors import ScalevecError

EPS = 1e-6


def _scale_params(shape, param: str, gen: torch.Generator) -> list[torch.Tensor]:
    """Leaf parameters of a scale site: [s] (plain) or [magnitude, alpha] (the spec's `or` / `er`)."""
    alpha = (1 + 0.5 * torch.randn(shape, generator=gen)).requires_grad_()
    if param == "plain":
        return [alpha]
    return [(0.2 * torch.randn(1, generator=gen)).requires_grad_(), alpha]


def _scale(params: list[torch.Tensor], param: str) -> torch.Tensor:
    """s from its parameters with ordinary torch ops: beta * alpha / rms(alpha), beta = 1 + m or exp(m)."""
    if param == "plain":
        return params[0]
    magnitude, alpha = params
    direction = alpha * torch.rsqrt(alpha.square().mean())
    return (1 + magnitude if param == "or" else magnitude.exp()) * direction


def _grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream)


def test_torch_backend_matches_functional_rms_norm():
    gen = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 5, 48, generator=gen), torch.randn(2, 5, 48, generator=gen)
    scales = [torch.randn(48, generator=gen), None, torch.randn(48, generator=gen)]
    *ys, h = rms_norm_scales(x, scales, EPS, residual=r, backend="torch")
    torch.testing.assert_close(h, x + r)
    for y, s in zip(ys, scales, strict=True):
        torch.testing.assert_close(y, F.rms_norm(x + r, (48,), s, EPS))
    (y,) = rms_norm_scales(x, None, EPS)  # auto on CPU: the reference
    torch.testing.assert_close(y, F.rms_norm(x, (48,), None, EPS))


def test_head_reference_normalizes_each_head():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 16, generator=gen)
    full = torch.randn(4, 16, generator=gen)
    expect = torch.stack([F.rms_norm(x[..., i, :], (16,), full[i], EPS) for i in range(4)], dim=-2)
    torch.testing.assert_close(head_rms_norm(x, full, EPS, backend="torch"), expect)
    torch.testing.assert_close(head_rms_norm(x, full.flatten(), EPS), expect)
    shared = full[0]
    torch.testing.assert_close(head_rms_norm_reference(x, shared, EPS), F.rms_norm(x, (16,), shared, EPS))


def test_bad_arguments_raise():
    x = torch.randn(3, 8)
    with pytest.raises(ScalevecError, match="kernels"):
        rms_norm_scales(x, [None], EPS, backend="cuda")
    with pytest.raises(ValueError, match="scales"):
        rms_norm_scales(x, [torch.ones(7)], EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_scales(x, [None], EPS, residual=torch.ones(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale has shape"):
        head_rms_norm(torch.randn(2, 4, 8), torch.ones(3, 8), EPS)


@pytest.mark.skipif(_INTERPRETED, reason="under TRITON_INTERPRET=1 the kernels do run on CPU")
def test_triton_backend_on_cpu_says_how_to_fix():
    pytest.importorskip("triton")
    with pytest.raises(ScalevecError, match="kernels=auto or torch"):
        rms_norm_scales(torch.randn(3, 8), [None], EPS, backend="triton")


def test_works_without_triton():
    """Without triton the package imports, runs the torch path and says why `triton` cannot run."""
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` fail
import torch
from scalevec_kernels import rms_norm_scales
from scalevec_train.errors import ScalevecError
x = torch.randn(3, 8)
(y,) = rms_norm_scales(x, None, 1e-6)
assert torch.allclose(y, torch.nn.functional.rms_norm(x, (8,), eps=1e-6))
try:
    rms_norm_scales(x, None, 1e-6, backend="triton")
except ScalevecError as e:
    assert "needs the triton package" in str(e)
else:
    raise AssertionError("backend='triton' ran without triton")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]


def _model_like(x, r, s_q, s_k, s_head, backend):
    """A block's norm traffic: a residual add, q/k pre-norm copies, and a per-head QK-norm."""
    q, k, h = rms_norm_scales(x, [s_q, s_k], EPS, residual=r, backend=backend)
    qh = head_rms_norm(q.unflatten(-1, (4, 8)), s_head, EPS, backend=backend)
    return (qh.flatten(-2) * k).sum() + h.square().sum()


def _compiled_matches_eager(backend):
    gen = torch.Generator().manual_seed(2)
    leaves = [torch.randn(2, 3, 32, generator=gen), torch.randn(2, 3, 32, generator=gen),
              torch.randn(32, generator=gen), torch.randn(32, generator=gen), torch.randn(8, generator=gen)]
    leaves = [t.requires_grad_() for t in leaves]
    compiled = torch.compile(_model_like, backend="aot_eager", fullgraph=True)
    loss = compiled(*leaves, backend)
    expect = _model_like(*leaves, backend)
    torch.testing.assert_close(loss, expect)
    for got, want in zip(_grads(loss, leaves, None), _grads(expect, leaves, None), strict=True):
        torch.testing.assert_close(got, want)


def test_compile_fullgraph_on_torch_backend():
    _compiled_matches_eager("auto")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.skipif(_INTERPRETED, reason="this process runs the test_interp_ tests itself")
def test_triton_kernels_in_interpreter():
    """Runs the test_interp_ tests below in a child process whose triton interprets the kernels."""
    triton = pytest.importorskip("triton")
    import numpy

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        pytest.skip("triton < 3.7 cannot interpret loops under numpy >= 2.4: use triton >= 3.7 or numpy < 2.4")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "test_interp_", __file__]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    # Exit code 5 (nothing collected) would mean the child's kernels were not interpreted either.
    assert child.returncode == 0, child.stdout[-8000:] + child.stderr[-4000:]


if _INTERPRETED:

    @pytest.mark.parametrize("n,m,k,residual,param", list(itertools.product(
        (123, 1000, 3000), (1, 199), (1, 2, 3), (False, True), ("plain", "or", "er"))))
    def test_interp_fused_matches_reference(n, m, k, residual, param):
        gen = torch.Generator().manual_seed(n * 1000 + m * 10 + k)
        x = torch.randn(m, n, generator=gen).requires_grad_()
        r = torch.randn(m, n, generator=gen).requires_grad_() if residual else None
        params = [_scale_params(n, param, gen) for _ in range(k)]
        leaves = [p for site in params for p in site]

        def run(backend):
            # Each run rebuilds s from its parameters, as the model does once per step.
            return rms_norm_scales(x, [_scale(site, param) for site in params], EPS, residual=r,
                                   backend=backend)

        got, want = run("triton"), run("torch")
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        upstream = [torch.randn(m, n, generator=gen) for _ in got]
        acts = [x] if r is None else [x, r]
        got_grads = _grads(got, acts + leaves, upstream)
        want_grads = _grads(want, acts + leaves, upstream)
        for a, b in zip(got_grads[:len(acts)], want_grads[:len(acts)], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads[len(acts):], want_grads[len(acts):], strict=True):
            _assert_scale_grad_close(a, b, m)

    def _assert_scale_grad_close(got, want, m):
        """The issue's bound: within 5e-6 * sqrt(M) of the reference, relative to its largest entry."""
        assert got.dtype == want.dtype and got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= 5e-6 * m ** 0.5 * want.abs().max().item(), (err, want.abs().max().item())

    def test_interp_unscaled_slots_and_four_outputs():
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(37, 200, generator=gen).requires_grad_()
        r = torch.randn(37, 200, generator=gen).requires_grad_()
        s1, s3 = (torch.randn(200, generator=gen).requires_grad_() for _ in range(2))
        # the last case scales the fourth slot, which no other CPU case reaches
        cases = (([s1, None, s3, None], r), (None, None), ([None, s3], r), ([None, s1, None, s3], None))
        for scales, res in cases:
            leaves = [x] + ([r] if res is not None else []) + [s for s in scales or [] if s is not None]
            got = rms_norm_scales(x, scales, EPS, residual=res, backend="triton")
            want = rms_norm_scales(x, scales, EPS, residual=res, backend="torch")
            upstream = [torch.randn(37, 200, generator=gen) for _ in got]
            for a, b in zip(got + _grads(got, leaves, upstream), want + _grads(want, leaves, upstream),
                            strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_interp_mixed_precision_computes_in_fp32():
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(9, 300, generator=gen).bfloat16().requires_grad_()
        s = (1 + 0.5 * torch.randn(300, generator=gen)).requires_grad_()
        (got,) = rms_norm_scales(x, [s], EPS, backend="triton")
        (want,) = rms_norm_scales(x, [s], EPS, backend="torch")
        assert got.dtype == torch.bfloat16
        # Both round the same fp32 value once: at most one bf16 step apart.
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
        upstream = torch.randn(9, 300, generator=gen).bfloat16()
        (gx, gs), (wx, ws) = _grads(got, [x, s], upstream), _grads(want, [x, s], upstream)
        assert gx.dtype == torch.bfloat16 and gs.dtype == torch.float32
        torch.testing.assert_close(gx.float(), wx.float(), rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(gs, ws, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("shape", [None, (40,), (3, 40), (120,)])
    @pytest.mark.parametrize("param", ["plain", "or"])
    def test_interp_head_matches_reference(shape, param):
        if shape is None and param == "or":
            pytest.skip("no scale to reparameterize")
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2, 7, 3, 40, generator=gen).requires_grad_()
        params = [] if shape is None else _scale_params(shape, param, gen)
        leaves = [x, *params]

        def run(backend):
            return head_rms_norm(x, _scale(params, param) if params else None, EPS, backend=backend)

        got, want = run("triton"), run("torch")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        upstream = torch.randn(got.shape, generator=gen)
        got_grads, want_grads = _grads(got, leaves, upstream), _grads(want, leaves, upstream)
        torch.testing.assert_close(got_grads[0], want_grads[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads[1:], want_grads[1:], strict=True):
            _assert_scale_grad_close(a, b, x.numel() // 40)

    def test_interp_compile_fullgraph_on_triton_backend():
        _compiled_matches_eager("triton")

    def test_interp_ops_pass_opcheck():
        """Schema, fake implementations (shapes, dtypes, strides) and autograd registration."""
        gen = torch.Generator().manual_seed(6)

        def leaf(*shape):
            return torch.randn(*shape, generator=gen).requires_grad_()

        fwd, bwd = torch.ops.scalevec.rms_norm_fwd, torch.ops.scalevec.rms_norm_bwd
        three_outputs = (leaf(5, 24), leaf(5, 24), [leaf(24), leaf(24)], [True, False, True], 1, EPS)
        torch.library.opcheck(fwd, three_outputs)
        heads = leaf(4, 3, 8)
        torch.library.opcheck(fwd, (heads, None, [leaf(24)], [True], 3, EPS))
        rstd = torch.rand(4, 3, generator=gen) + 0.5
        torch.library.opcheck(bwd, ([torch.randn(4, 3, 8, generator=gen)], None, heads.detach(), rstd,
                                    [torch.randn(24, generator=gen)], [True], 3))

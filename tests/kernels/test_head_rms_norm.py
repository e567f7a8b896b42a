"""The per-head RMSNorm (scalevec_kernels.head_rms_norm) against plain PyTorch, on CPU in fp32.

The Triton kernels run in triton's CPU interpreter, in a child process
(see tests/support/kernels.py).
"""

import pytest
import torch
import torch.nn.functional as F

from scalevec_kernels import KernelError, head_rms_norm, head_rms_norm_reference
from scalevec_kernels.backend import INTERPRETED
from tests.support.kernels import EPS, assert_scale_grad_close, grads, scale_site


def test_head_reference_normalizes_each_head():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 16, generator=gen)
    full = torch.randn(4, 16, generator=gen)
    expect = torch.stack([F.rms_norm(x[..., i, :], (16,), full[i], EPS) for i in range(4)], dim=-2)
    torch.testing.assert_close(head_rms_norm(x, full, EPS, backend="torch"), expect)
    torch.testing.assert_close(head_rms_norm(x, full.flatten(), EPS), expect)
    shared = full[0]
    torch.testing.assert_close(head_rms_norm_reference(x, shared, EPS),
                               F.rms_norm(x, (16,), shared, EPS))


def test_bad_scale_shape_raises():
    with pytest.raises(KernelError, match="scale has shape"):
        head_rms_norm(torch.randn(2, 4, 8), torch.ones(3, 8), EPS)


if INTERPRETED:

    @pytest.mark.parametrize("shape", [None, (40,), (3, 40), (120,)])
    @pytest.mark.parametrize("param", ["plain", "or"])
    def test_interp_head_matches_reference(shape, param):
        if shape is None and param == "or":
            pytest.skip("no scale to reparameterize")
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2, 7, 3, 40, generator=gen).requires_grad_()
        site = None if shape is None else scale_site(shape, param, gen)
        leaves = [x, *([] if site is None else site.parameters())]

        def run(backend):
            return head_rms_norm(x, None if site is None else site(), EPS, backend=backend)

        got, want = run("triton"), run("torch")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        upstream = torch.randn(got.shape, generator=gen)
        got_grads, want_grads = grads(got, leaves, upstream), grads(want, leaves, upstream)
        torch.testing.assert_close(got_grads[0], want_grads[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads[1:], want_grads[1:], strict=True):
            assert_scale_grad_close(a, b, x.numel() // 40)

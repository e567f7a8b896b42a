"""The fused RMSNorm+scale kernels (scalevec_kernels.rms_norm) against plain PyTorch, on CPU in
fp32.

The Triton kernels run in triton's CPU interpreter, in a child process
(see tests/support/kernels.py).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from scalevec_kernels import KernelError, head_rms_norm, rms_norm, rms_norm_scales
from scalevec_kernels.backend import INTERPRETED
from tests.support.kernels import (
    EPS,
    assert_scale_grad_close,
    grads,
    host_ops,
    scale_site,
)


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


def test_bad_arguments_raise():
    x = torch.randn(3, 8)
    with pytest.raises(KernelError, match="kernels"):
        rms_norm_scales(x, [None], EPS, backend="cuda")
    with pytest.raises(KernelError, match="scales"):
        rms_norm_scales(x, [torch.ones(7)], EPS)
    with pytest.raises(KernelError, match="residual"):
        rms_norm_scales(x, [None], EPS, residual=torch.ones(3, 8, dtype=torch.float64))


def _model_like(x, r, s_q, s_k, s_head, backend):
    """A block's norm traffic: a residual add, q/k pre-norm copies, and a per-head QK-norm."""
    q, k, h = rms_norm_scales(x, [s_q, s_k], EPS, residual=r, backend=backend)
    qh = head_rms_norm(q.unflatten(-1, (4, 8)), s_head, EPS, backend=backend)
    return (qh.flatten(-2) * k).sum() + h.square().sum()


def _compiled_matches_eager(backend):
    gen = torch.Generator().manual_seed(2)
    leaves = [torch.randn(2, 3, 32, generator=gen), torch.randn(2, 3, 32, generator=gen),
              torch.randn(32, generator=gen), torch.randn(32, generator=gen),
              torch.randn(8, generator=gen)]
    leaves = [t.requires_grad_() for t in leaves]
    compiled = torch.compile(_model_like, backend="aot_eager", fullgraph=True)
    loss = compiled(*leaves, backend)
    expect = _model_like(*leaves, backend)
    torch.testing.assert_close(loss, expect)
    for got, want in zip(grads(loss, leaves, None), grads(expect, leaves, None), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.skipif(INTERPRETED, reason="aot.capture records the compiled kernels' launches")
def test_compile_traces_the_ops_in_one_graph():
    """torch.compile(fullgraph=True) of a block's norm traffic on the kernel path keeps the custom
    ops in one forward and one backward graph, and the compiled graphs launch the kernels. Off the
    interpreter the kernels cannot run on CPU, so aot.capture (dev/kernel_tools) records their
    launches (the numbers are the interpreter test's:
    test_interp_compile_fullgraph_on_triton_backend)."""
    pytest.importorskip("triton")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from dev.kernel_tools import aot

    graphs = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    gen = torch.Generator().manual_seed(2)
    leaves = [torch.randn(shape, generator=gen).requires_grad_()
              for shape in ((2, 3, 32), (2, 3, 32), 32, 32, 8)]
    torch._dynamo.reset()
    compiled = torch.compile(_model_like, backend=aot_autograd(fw_compiler=keep("fwd"),
                                                               bw_compiler=keep("bwd")),
                             fullgraph=True)
    with aot.capture() as launches:
        compiled(*leaves, "triton").backward()
    # the pre-norm with q, k and the residual, and the per-head norm: two fused ops each way
    assert graphs["fwd"].count("scalevec.rms_norm_fwd.default") == 2, graphs["fwd"]
    assert graphs["bwd"].count("scalevec.rms_norm_bwd.default") == 2, graphs["bwd"]
    assert {v.kernel for v in launches.variants} == {"rms_norm._fwd_kernel", "rms_norm._bwd_kernel",
                                                     "partials._reduce_kernel"}


@pytest.mark.skipif(INTERPRETED, reason="aot.capture records the compiled kernels' launches")
def test_a_call_issues_its_launches_and_allocations_alone():
    """Forward and backward of K = 3 outputs (one unscaled) with a residual, and of a per-head norm
    with a full-width scale, on the kernel path: the host issues the kernel launches (the scale
    gradients summed from the backward's partials by a kernel) and allocates what they write, and
    runs no other torch op."""
    pytest.importorskip("triton")
    x, r = (torch.randn(64, 256, requires_grad=True) for _ in range(2))
    scales = [torch.ones(256, requires_grad=True), None, torch.ones(256, requires_grad=True)]
    upstream = [torch.ones(64, 256) for _ in range(4)]
    ops, calls = host_ops(lambda: grads(rms_norm_scales(x, scales, EPS, residual=r,
                                                        backend="triton"),
                                        [x, r, scales[0], scales[2]], upstream))
    assert calls == ["rms_norm._fwd_kernel", "rms_norm._bwd_kernel", "partials._reduce_kernel"]
    # forward: 3 outputs, h, rstd; backward: dx, 2 scale gradients, the partials
    assert ops == {"aten::empty": 5 + 4}
    heads, scale = torch.randn(64, 4, 32, requires_grad=True), torch.ones(4, 32, requires_grad=True)
    upstream = torch.ones(64, 4, 32)
    ops, calls = host_ops(lambda: grads(head_rms_norm(heads, scale, EPS, backend="triton"),
                                        [heads, scale], upstream))
    assert calls == ["rms_norm._fwd_kernel", "rms_norm._bwd_kernel", "partials._reduce_kernel"]
    # y, the empty h, rstd; dx, the scale's gradient, the partials
    assert ops == {"aten::empty": 3 + 3}


if INTERPRETED:

    # Every combination of what the kernels see (widths: tiles of 64, 64 and 16 rows; one row or
    # several programs with a partial last tile; 1-3 outputs; with and without a residual). The
    # scale's parametrization only changes how torch builds s from its parameters, not the kernels'
    # path: it cycles over the combinations so that each value meets every width, row count, K and
    # residual.
    @pytest.mark.parametrize("n,m,k,residual,param", [
        (n, m, k, residual, ("plain", "or", "er")[(i + k + residual) % 3])
        for i, n in enumerate((123, 1000, 3000))
        for m, k, residual in itertools.product((1, 199), (1, 2, 3), (False, True))])
    def test_interp_fused_matches_reference(n, m, k, residual, param):
        gen = torch.Generator().manual_seed(n * 1000 + m * 10 + k)
        x = torch.randn(m, n, generator=gen).requires_grad_()
        r = torch.randn(m, n, generator=gen).requires_grad_() if residual else None
        sites = [scale_site(n, param, gen) for _ in range(k)]
        leaves = [p for site in sites for p in site.parameters()]

        def run(backend):
            # Each run rebuilds s from its parameters, as the model does once per step.
            return rms_norm_scales(x, [site() for site in sites], EPS, residual=r,
                                   backend=backend)

        got, want = run("triton"), run("torch")
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        upstream = [torch.randn(m, n, generator=gen) for _ in got]
        acts = [x] if r is None else [x, r]
        got_grads = grads(got, acts + leaves, upstream)
        want_grads = grads(want, acts + leaves, upstream)
        for a, b in zip(got_grads[:len(acts)], want_grads[:len(acts)], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_grads[len(acts):], want_grads[len(acts):], strict=True):
            assert_scale_grad_close(a, b, m)

    @pytest.mark.parametrize("n,m,k,groups", [(200, 37, 4, 1), (300, 9, 2, 1), (64, 24, 1, 3)])
    def test_interp_chunked_backward_matches_reference(monkeypatch, n, m, k, groups):
        """Rows walked in chunks of 64 features (several per row, the last one partial) by tiles of
        two rows over several programs: the path that rows wider than the GPU's chunk take. groups=3
        is the per-head norm with a full-width scale (one partial per head)."""
        monkeypatch.setattr(rms_norm, "_BWD_CHUNK", 32 if groups > 1 else 64)
        monkeypatch.setattr(rms_norm, "_BWD_TILE", 128)
        grid = rms_norm.backward_grid(n, m, groups, 4 * (k + 1), 4 * (k + 3), True,
                                      torch.device("cpu"))
        assert grid[1] < n  # several chunks a row
        gen = torch.Generator().manual_seed(n + k)
        x = torch.randn(m, n, generator=gen).requires_grad_()
        r = torch.randn(m, n, generator=gen).requires_grad_()
        if groups == 1:
            scales = [(1 + 0.5 * torch.randn(n, generator=gen)).requires_grad_() for _ in range(k)]
            if k > 1:
                scales[1] = None  # an unscaled slot among scaled ones
            leaves = [x, r] + [s for s in scales if s is not None]

            def run(backend):
                return rms_norm_scales(x, scales, EPS, residual=r, backend=backend)
        else:
            full = (1 + 0.5 * torch.randn(groups, n, generator=gen)).requires_grad_()
            leaves = [x, full]

            def run(backend):
                return (head_rms_norm(x.unflatten(0, (m // groups, groups)), full, EPS,
                                      backend=backend),)

        got, want = run("triton"), run("torch")
        upstream = [torch.randn(o.shape, generator=gen) for o in got]
        for a, b in zip(grads(got, leaves, upstream), grads(want, leaves, upstream), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_interp_unscaled_slots_and_four_outputs():
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(37, 200, generator=gen).requires_grad_()
        r = torch.randn(37, 200, generator=gen).requires_grad_()
        s1, s3 = (torch.randn(200, generator=gen).requires_grad_() for _ in range(2))
        # the last case scales the fourth slot, which no other CPU case reaches
        cases = (([s1, None, s3, None], r), (None, None), ([None, s3], r),
                 ([None, s1, None, s3], None))
        for scales, res in cases:
            leaves = ([x] + ([r] if res is not None else [])
                      + [s for s in scales or [] if s is not None])
            got = rms_norm_scales(x, scales, EPS, residual=res, backend="triton")
            want = rms_norm_scales(x, scales, EPS, residual=res, backend="torch")
            upstream = [torch.randn(37, 200, generator=gen) for _ in got]
            for a, b in zip(got + grads(got, leaves, upstream),
                            want + grads(want, leaves, upstream), strict=True):
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
        (gx, gs), (wx, ws) = grads(got, [x, s], upstream), grads(want, [x, s], upstream)
        assert gx.dtype == torch.bfloat16 and gs.dtype == torch.float32
        torch.testing.assert_close(gx.float(), wx.float(), rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(gs, ws, rtol=1e-5, atol=1e-5)

    def test_interp_compile_fullgraph_on_triton_backend():
        _compiled_matches_eager("triton")

    def test_interp_ops_pass_opcheck():
        """Schema, fake implementations (shapes, dtypes, strides) and autograd registration."""
        gen = torch.Generator().manual_seed(6)

        def leaf(*shape):
            return torch.randn(*shape, generator=gen).requires_grad_()

        fwd, bwd = torch.ops.scalevec.rms_norm_fwd, torch.ops.scalevec.rms_norm_bwd
        three_outputs = (leaf(5, 24), leaf(5, 24), [leaf(24), leaf(24)], [True, False, True], 1,
                         EPS)
        torch.library.opcheck(fwd, three_outputs)
        heads = leaf(4, 3, 8)
        torch.library.opcheck(fwd, (heads, None, [leaf(24)], [True], 3, EPS))
        rstd = torch.rand(4, 3, generator=gen) + 0.5
        torch.library.opcheck(bwd, ([torch.randn(4, 3, 8, generator=gen)], None, heads.detach(),
                                    rstd, [torch.randn(24, generator=gen)], [True], 3))

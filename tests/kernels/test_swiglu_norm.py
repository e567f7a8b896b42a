"""The fused normalization + SwiGLU (scalevec_kernels.swiglu_norm) against plain PyTorch, on CPU.

The Triton kernels run in triton's CPU interpreter, in fp32, in a child process (see
tests/support/kernels.py).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from scalevec_kernels import (
    KernelError,
    rms_norm_scales_reference,
    swiglu_norm,
    swiglu_norm_reference,
)
from scalevec_kernels.backend import INTERPRETED
from tests.support.kernels import EPS, grads, host_ops

# The module (the package's name swiglu_norm is the function).
swiglu_kernels = importlib.import_module("scalevec_kernels.swiglu_norm")

# Rows per expert, empty experts included: offsets [3, 3, 8, 8].
COUNTS = [3, 0, 5, 0]


def _offsets(counts, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(dtype)


def _scale(shape, gen) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(shape, generator=gen)).requires_grad_()


def test_reference_is_the_unfused_path_bit_for_bit():
    """The model's path: a scaled norm per branch (per expert: on that expert's rows), then
    silu(g) * u."""
    gen = torch.Generator().manual_seed(0)
    g, u = (torch.randn(8, 96, generator=gen).bfloat16() for _ in range(2))
    sg, su = torch.randn(96, generator=gen), torch.randn(96, generator=gen).bfloat16()
    (gn,), (un,) = rms_norm_scales_reference(g, [sg], EPS), rms_norm_scales_reference(u, [su], EPS)
    assert torch.equal(swiglu_norm(g, u, sg, su, EPS, backend="torch"), F.silu(gn) * un)
    (gn,), (un,) = (rms_norm_scales_reference(g, [None], EPS),
                    rms_norm_scales_reference(u, [None], EPS))
    # auto on CPU: the reference
    assert torch.equal(swiglu_norm(g, u, None, None, EPS), F.silu(gn) * un)

    sg, su = torch.randn(4, 96, generator=gen), torch.randn(4, 96, generator=gen)
    got = swiglu_norm(g, u, sg, su, EPS, expert_offsets=_offsets(COUNTS), backend="torch")
    start = 0
    for e, count in enumerate(COUNTS):
        rows = slice(start, start + count)
        (gn,) = rms_norm_scales_reference(g[rows], [sg[e]], EPS)
        (un,) = rms_norm_scales_reference(u[rows], [su[e]], EPS)
        assert torch.equal(got[rows], F.silu(gn) * un), e
        start += count


def test_reference_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    g, u = (torch.randn(2, 3, 5, generator=gen, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    sg = (1 + torch.randn(3, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    su = (1 + torch.randn(5, generator=gen, dtype=torch.float64)).requires_grad_()
    offsets = _offsets([2, 0, 4])
    assert torch.autograd.gradcheck(lambda *t: swiglu_norm_reference(*t, EPS, offsets),
                                    (g, u, sg, su))


def test_bad_arguments_raise():
    g = torch.randn(8, 16)
    with pytest.raises(KernelError, match="gate .* and up .* differ"):
        swiglu_norm(g, g.double(), None, None, EPS)
    with pytest.raises(KernelError, match=r"gate_scale has shape \(4, 16\), expected \(16,\)"):
        swiglu_norm(g, g, torch.ones(4, 16), None, EPS)
    with pytest.raises(KernelError,
                       match=r"up_scale has shape \(3, 16\), expected \(16,\) or \(4, 16\)"):
        swiglu_norm(g, g, None, torch.ones(3, 16), EPS, expert_offsets=_offsets(COUNTS))
    with pytest.raises(KernelError, match="expert_offsets"):
        swiglu_norm(g, g, torch.ones(4, 16), None, EPS, expert_offsets=_offsets(COUNTS).float())
    with pytest.raises(KernelError, match="unknown kernels backend"):
        swiglu_norm(g, g, None, None, EPS, backend="cuda")


@pytest.mark.skipif(INTERPRETED, reason="under TRITON_INTERPRET=1 the kernels do run on CPU")
def test_triton_backend_on_cpu_raises():
    pytest.importorskip("triton")
    g = torch.randn(8, 16)
    with pytest.raises(KernelError, match="needs CUDA tensors"):
        swiglu_norm(g, g, torch.ones(16), None, EPS, backend="triton")


@pytest.mark.skipif(INTERPRETED, reason="aot.capture records the compiled kernels' launches")
def test_a_call_issues_its_launches_and_allocations_alone():
    """Forward and backward with a per-expert gate scale and a shared up scale (summed over the
    experts by the reduction kernel): the host issues the kernel launches and allocates what they
    write, no more."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    g, u = (torch.randn(8, 64, generator=gen).requires_grad_() for _ in range(2))
    gate_scale, up_scale, offsets = _scale((4, 64), gen), _scale(64, gen), _offsets(COUNTS)
    upstream = torch.ones(8, 64)
    ops, calls = host_ops(lambda: grads(swiglu_norm(g, u, gate_scale, up_scale, EPS, offsets,
                                                    backend="triton"),
                                        [g, u, gate_scale, up_scale], upstream))
    assert calls == ["swiglu_norm._fwd_kernel", "swiglu_norm._bwd_kernel",
                     "partials._reduce_kernel"]
    assert ops == {"aten::empty": 2 + 5}  # out, rstd; dgate, dup, two scale gradients, the partials


if INTERPRETED:

    def _case(kind, f, counts, gen):
        """(gate_scale, up_scale, expert_offsets) of a case; per-expert cases use int32 and int64
        offsets."""
        experts = len(counts)
        return {
            "none": (None, None, None),
            "shared": (_scale(f, gen), _scale(f, gen), None),
            "experts": (_scale((experts, f), gen), _scale((experts, f), gen), _offsets(counts)),
            "experts_and_shared": (_scale((experts, f), gen), _scale(f, gen),
                                   _offsets(counts, torch.int32)),
            "up_experts_only": (None, _scale((experts, f), gen), _offsets(counts)),
        }[kind]

    KINDS = ["none", "shared", "experts", "experts_and_shared", "up_experts_only"]

    # Widths a power of two and not; 200 rows make several tiles per program and, without experts,
    # several programs (three in the interpreter).
    @pytest.mark.parametrize("f,counts,kind", [
        pytest.param(f, counts, kind, id=f"{f}-{sum(counts)}rows-{kind}")
        for f, counts, kinds in ((64, COUNTS, KINDS[:3]), (344, COUNTS, KINDS),
                                 (96, [70, 0, 130, 0], KINDS[1:3]))
        for kind in kinds])
    def test_interp_matches_reference(f, counts, kind):
        """Forward and every gradient in fp32."""
        gen = torch.Generator().manual_seed(f + len(kind) + sum(counts))
        rows = sum(counts)
        g, u = (torch.randn(2, rows // 2, f, generator=gen).requires_grad_() for _ in range(2))
        gate_scale, up_scale, offsets = _case(kind, f, counts, gen)
        leaves = [t for t in (g, u, gate_scale, up_scale) if t is not None]
        got = swiglu_norm(g, u, gate_scale, up_scale, EPS, offsets, backend="triton")
        want = swiglu_norm(g, u, gate_scale, up_scale, EPS, offsets, backend="torch")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        upstream = torch.randn(got.shape, generator=gen)
        for a, b in zip(grads(got, leaves, upstream), grads(want, leaves, upstream), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("f,counts,kind", [(200, [40], "shared"),
                                               (96, [7, 0, 13, 4], "experts_and_shared"),
                                               (130, [11], "none")])
    def test_interp_chunked_rows_match_reference(monkeypatch, f, counts, kind):
        """Rows walked in chunks of 32 features (several per row, the last one partial) by tiles of
        two rows, forward and backward over several programs: the path that rows wider than the
        GPU's tile take (8192 features: dense-1b's FFN)."""
        monkeypatch.setattr(swiglu_kernels, "_CHUNK", 32)
        monkeypatch.setattr(swiglu_kernels, "_FWD_TILE", 64)
        monkeypatch.setattr(swiglu_kernels, "_BWD_TILE", 64)
        rows = sum(counts)
        assert swiglu_kernels.backward_grid(f, rows, len(counts), 12, 20,
                                            torch.device("cpu"))[1] < f
        assert swiglu_kernels.forward_tile(f)[:2] == (2, 32)
        gen = torch.Generator().manual_seed(f + rows)
        g, u = (torch.randn(rows, f, generator=gen).requires_grad_() for _ in range(2))
        gate_scale, up_scale, offsets = _case(kind, f, counts, gen)
        leaves = [t for t in (g, u, gate_scale, up_scale) if t is not None]
        got = swiglu_norm(g, u, gate_scale, up_scale, EPS, offsets, backend="triton")
        want = swiglu_norm(g, u, gate_scale, up_scale, EPS, offsets, backend="torch")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        upstream = torch.randn(got.shape, generator=gen)
        for a, b in zip(grads(got, leaves, upstream), grads(want, leaves, upstream), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    def test_interp_mixed_precision_keeps_each_dtype():
        """bf16 gate/up, an fp32 per-expert and a bf16 shared scale: the output and every gradient
        in its input's dtype, within twice the error of PyTorch's own computation against float64
        (as on the GPU)."""
        gen = torch.Generator().manual_seed(7)
        inputs = [torch.randn(8, 96, generator=gen).bfloat16(),
                  torch.randn(8, 96, generator=gen).bfloat16(),
                  _scale((4, 96), gen), _scale(96, gen).bfloat16()]
        upstream = torch.randn(8, 96, generator=gen)

        def run(backend, dtype=None):
            leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
            out = swiglu_norm(*leaves, EPS, _offsets(COUNTS), backend=backend)
            return [out, *grads(out, leaves, upstream.to(out.dtype))]

        fused, lowp, ref = run("triton"), run("torch"), run("torch", torch.float64)
        for a, b, c, like in zip(fused, lowp, ref, inputs[:1] + inputs, strict=True):
            assert a.dtype == b.dtype == like.dtype and a.shape == c.shape
            err, base = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
            assert err <= 2 * base + 1e-5 * c.abs().max().item(), (err, base)

    def test_interp_ops_pass_opcheck():
        """Schema, fake implementations (shapes, dtypes, strides) and autograd registration."""
        gen = torch.Generator().manual_seed(8)
        g, u = (torch.randn(8, 24, generator=gen).requires_grad_() for _ in range(2))
        fwd, bwd = torch.ops.scalevec.swiglu_norm_fwd, torch.ops.scalevec.swiglu_norm_bwd
        torch.library.opcheck(fwd, (g, u, _scale((4, 24), gen), _scale(24, gen), _offsets(COUNTS),
                                    EPS))
        rstd = torch.rand(2, 8, generator=gen) + 0.5
        torch.library.opcheck(bwd, (torch.randn(8, 24, generator=gen), g.detach(), u.detach(), rstd,
                                    torch.randn(4, 24, generator=gen), None, _offsets(COUNTS)))

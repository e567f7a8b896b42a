"""The compiled Triton kernels on CUDA (run by `make test-gpu`; skipped without CUDA or triton).

bf16 criterion, as flash-attention's: against an fp32 reference computed from the same bf16 inputs,
the fused kernels' error is at most twice the error of PyTorch's own bf16 computation (the torch
backend run on the bf16 tensors) plus a small atol.
"""

import itertools

import pytest
import torch

from scalevec_kernels import head_rms_norm, rms_norm_scales, swiglu_norm
from scalevec_kernels.backend import INTERPRETED

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("triton")

EPS = 1e-6


@pytest.fixture(autouse=True)
def _compiled_kernels():
    if INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1: these tests are for the compiled kernels")


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _assert_within_twice_torch_error(fused, torch_lowp, ref, what):
    ref = ref.float()
    err = (fused.float() - ref).abs().max().item()
    base = (torch_lowp.float() - ref).abs().max().item()
    atol = 1e-5 * (1 + ref.abs().max().item())
    assert fused.dtype == torch_lowp.dtype, what
    assert err <= 2 * base + atol, f"{what}: fused error {err:.3g}, torch bf16 error {base:.3g}"


def _run(fn, leaves, upstream):
    """Outputs, then the gradients of every leaf; upstream gradients are cast to each output's
    dtype."""
    outs = fn(*leaves)
    grads = torch.autograd.grad(outs, leaves,
                                [u.to(o.dtype) for o, u in zip(outs, upstream, strict=True)])
    return list(outs) + list(grads)


@pytest.mark.parametrize("m,n,k,residual,scale_dtype", list(itertools.product(
    (1, 3001), (768, 1000, 4096), (1, 2, 3), (False, True), (torch.bfloat16, torch.float32))) + [
    (257, 8192, 3, True, torch.float32), (129, 16384, 3, True, torch.bfloat16),
    (513, 2048, 4, True, torch.float32)])
def test_rows_bf16_within_twice_torch_error(m, n, k, residual, scale_dtype):
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    r = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    scales = [(1 + 0.5 * torch.randn(n, device="cuda", generator=gen)).to(scale_dtype)
              for _ in range(k)]
    upstream = [torch.randn(m, n, device="cuda", generator=gen).bfloat16()
                for _ in range(k + residual)]
    names = [f"y{i}" for i in range(k)] + ["h"] * residual + ["dx"] + ["dr"] * residual
    names += [f"ds{i}" for i in range(k)]

    def call(backend):
        def fn(x, *rest):
            res, ss = (rest[0], rest[1:]) if residual else (None, rest)
            return rms_norm_scales(x, list(ss), EPS, residual=res, backend=backend)
        return fn

    inputs = [x, r, *scales] if residual else [x, *scales]
    fused = _run(call("triton"), _leaves(*inputs), upstream)
    lowp = _run(call("torch"), _leaves(*inputs), upstream)
    ref = _run(call("torch"), _leaves(*(t.float() for t in inputs)), upstream)
    for name, a, b, c in zip(names, fused, lowp, ref, strict=True):
        _assert_within_twice_torch_error(a, b, c, name)


@pytest.mark.parametrize("d,heads,shape", [(128, 8, "shared"), (128, 8, "full"), (64, 32, "full"),
                                           (96, 5, "none")])
def test_head_bf16_within_twice_torch_error(d, heads, shape):
    gen = torch.Generator(device="cuda").manual_seed(d * heads)
    x = torch.randn(3, 1000, heads, d, device="cuda", generator=gen).bfloat16()
    scale_shape = {"shared": (d,), "full": (heads, d), "none": None}[shape]
    inputs = ([x] if scale_shape is None
              else [x, 1 + 0.5 * torch.randn(scale_shape, device="cuda", generator=gen)])
    upstream = [torch.randn(x.shape, device="cuda", generator=gen).bfloat16()]

    def call(backend):
        return lambda x, *s: (head_rms_norm(x, s[0] if s else None, EPS, backend=backend),)

    fused = _run(call("triton"), _leaves(*inputs), upstream)
    lowp = _run(call("torch"), _leaves(*inputs), upstream)
    ref = _run(call("torch"), _leaves(*(t.float() for t in inputs)), upstream)
    for name, a, b, c in zip(["y", "dx", "ds"], fused, lowp, ref, strict=False):
        _assert_within_twice_torch_error(a, b, c, name)


def test_fp32_matches_reference_tightly():
    gen = torch.Generator(device="cuda").manual_seed(7)
    inputs = [torch.randn(4097, 2000, device="cuda", generator=gen),
              torch.randn(2000, device="cuda", generator=gen),
              torch.randn(2000, device="cuda", generator=gen)]
    upstream = [torch.randn(4097, 2000, device="cuda", generator=gen) for _ in range(2)]
    fused = _run(lambda x, a, b: rms_norm_scales(x, [a, b], EPS, backend="triton"),
                 _leaves(*inputs), upstream)
    ref = _run(lambda x, a, b: rms_norm_scales(x, [a, b], EPS, backend="torch"), _leaves(*inputs),
               upstream)
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()))


def _swiglu_inputs(m, f, kind, dtype, gen):
    """gate, up and (gate_scale, up_scale, expert_offsets) for a scale kind: none, shared or experts
    (eight experts of uneven size, two of them empty, the gate's scale per expert, the up's
    shared)."""
    gate, up = (torch.randn(m, f, device="cuda", generator=gen).to(dtype) for _ in range(2))

    def s(*shape):
        return 1 + 0.5 * torch.randn(*shape, device="cuda", generator=gen)

    if kind == "none":
        return gate, up, (None, None, None)
    if kind == "shared":
        return gate, up, (s(f), s(f), None)
    cuts = torch.randint(0, m + 1, (5,), device="cuda", generator=gen).sort().values
    offsets = torch.cat([cuts[:2], cuts[1:2], cuts[2:], torch.full((2,), m, device="cuda")])
    return gate, up, (s(8, f), s(f), offsets)


@pytest.mark.parametrize("m,f,kind", [(4097, 2304, "shared"), (4096, 1408, "experts"),
                                      (3001, 1000, "none"), (1024, 8192, "shared"),
                                      (513, 16384, "experts")])
def test_swiglu_bf16_within_twice_torch_error(m, f, kind):
    gen = torch.Generator(device="cuda").manual_seed(m + f)
    gate, up, (gate_scale, up_scale, offsets) = _swiglu_inputs(m, f, kind, torch.bfloat16, gen)
    scales = [t for t in (gate_scale, up_scale) if t is not None]
    upstream = [torch.randn(m, f, device="cuda", generator=gen)]

    def call(backend):
        def fn(g, u, *ss):
            it = iter(ss)
            sg, su = (None if t is None else next(it) for t in (gate_scale, up_scale))
            return (swiglu_norm(g, u, sg, su, EPS, offsets, backend=backend),)
        return fn

    inputs = [gate, up, *scales]
    fused = _run(call("triton"), _leaves(*inputs), upstream)
    lowp = _run(call("torch"), _leaves(*inputs), upstream)
    ref = _run(call("torch"), _leaves(*(t.float() for t in inputs)), upstream)
    names = ["out", "dgate", "dup"] + [f"ds{i}" for i in range(len(scales))]
    for name, a, b, c in zip(names, fused, lowp, ref, strict=True):
        _assert_within_twice_torch_error(a, b, c, name)


def test_swiglu_fp32_matches_reference_tightly_and_deterministically():
    gen = torch.Generator(device="cuda").manual_seed(10)
    gate, up, (gate_scale, up_scale, offsets) = _swiglu_inputs(8192, 1536, "experts", torch.float32,
                                                               gen)
    upstream = [torch.randn(8192, 1536, device="cuda", generator=gen)]

    def fn(backend):
        return lambda g, u, sg, su: (swiglu_norm(g, u, sg, su, EPS, offsets, backend=backend),)

    inputs = [gate, up, gate_scale, up_scale]
    fused = _run(fn("triton"), _leaves(*inputs), upstream)
    ref = _run(fn("torch"), _leaves(*inputs), upstream)
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * (1 + b.abs().max().item()))
    for a, b in zip(_run(fn("triton"), _leaves(*inputs), upstream), fused, strict=True):
        assert torch.equal(a, b)


def test_backward_is_deterministic():
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(8192, 1024, device="cuda", generator=gen).bfloat16()
    s = [torch.randn(1024, device="cuda", generator=gen) for _ in range(3)]
    upstream = [torch.randn(8192, 1024, device="cuda", generator=gen) for _ in range(3)]
    fn = lambda x, *s: rms_norm_scales(x, list(s), EPS, backend="triton")  # noqa: E731
    first = _run(fn, _leaves(x, *s), upstream)
    second = _run(fn, _leaves(x, *s), upstream)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_auto_picks_the_fused_op_on_cuda():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 64, device="cuda")
    with Record() as rec:
        rms_norm_scales(x, [None], EPS)
        swiglu_norm(x, x, None, None, EPS)
    assert any("scalevec.rms_norm_fwd" in op for op in rec.ops), rec.ops
    assert any("scalevec.swiglu_norm_fwd" in op for op in rec.ops), rec.ops


def test_inductor_fullgraph_matches_eager():
    gen = torch.Generator(device="cuda").manual_seed(9)

    def block(x, r, s_q, s_k, s_head):
        q, k, h = rms_norm_scales(x, [s_q, s_k], EPS, residual=r)
        qh = head_rms_norm(q.unflatten(-1, (8, 64)), s_head, EPS).flatten(-2)
        return (qh * k).sum() + h.square().sum()

    shapes = [(2, 256, 512), (2, 256, 512), (512,), (512,), (64,)]
    inputs = [torch.randn(shape, device="cuda", generator=gen) for shape in shapes]
    eager_leaves, compiled_leaves = _leaves(*inputs), _leaves(*inputs)
    want = block(*eager_leaves)
    got = torch.compile(block, fullgraph=True)(*compiled_leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for a, b in zip(torch.autograd.grad(got, compiled_leaves),
                    torch.autograd.grad(want, eager_leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

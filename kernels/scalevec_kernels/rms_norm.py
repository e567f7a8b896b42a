"""Fused RMSNorm with K scaled outputs: y_k = s_k * N(x), N(x) = x / sqrt(mean(x^2) + eps).

A block's pre-norm feeds several branches (q/k/v, gate/up), each with its own scale vector. Writing
every branch's scaled copy from one read of x makes the norm cost (1 + K) row transfers instead of
2K, and the backward reads x once for all K scale gradients (rows wider than the backward's widest
tile, 4096 features, are walked in chunks twice: once for the row reduction, once for dx, the second
read mostly from cache, so that no tile outgrows its registers).

This file holds the Triton kernels, the `scalevec::rms_norm_fwd/bwd` ops with their fake
implementations and autograd wiring, and the plain PyTorch reference. The ops take a `groups`
argument: row r of the flattened input uses scale row r % groups, which is how the per-head variant
in head_rms_norm.py indexes a full-width [H, D] scale.
"""

import torch
from torch import Tensor

from .backend import (
    BACKWARD_PER_THREAD,
    INTERPRETED,
    MAX_REGISTERS,
    backward_tile,
    chunked_tile,
    forward_registers,
    pointer_slots,
    resident_programs,
    tile,
    tl,
    triton,
    use_triton,
)
from .errors import KernelError
from .partials import reduce_partials

# One pointer argument per output/scale slot in the kernels; the forward holds whole rows in
# registers.
MAX_SCALES = 4
MAX_FEATURES = 16384
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernels' [rows, N] arguments: the large tensors the memory model counts
# (dev/kernel_tools/traffic.py)
ROW_ARGS = {"_fwd_kernel": ("X", "R", "H", "Y0", "Y1", "Y2", "Y3"),
            "_bwd_kernel": ("X", "DH", "DX", "DY0", "DY1", "DY2", "DY3")}


def rms_norm_scales_reference(x: Tensor, scales: list[Tensor | None], eps: float,
                              residual: Tensor | None = None) -> tuple[Tensor, ...]:
    """Plain PyTorch: (y_1, ..., y_K), plus h = x + residual last when a residual is given."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.square().mean(-1, keepdim=True) + eps)
    ys = tuple((normed if s is None else normed * s.float()).to(x.dtype) for s in scales)
    return ys if residual is None else (*ys, h)


def rms_norm_scales(x: Tensor, scales: list[Tensor | None] | None, eps: float,
                    residual: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, ...]:
    """K scaled copies of N(x) (or of N(x + residual), with h = x + residual returned last)."""
    scales = [None] if scales is None else list(scales)
    if not scales:
        raise KernelError("rms_norm_scales: scales is empty.",
                          "Pass [None] for one unscaled output.")
    n = x.shape[-1]
    for i, s in enumerate(scales):
        if s is not None and s.shape != (n,):
            raise KernelError(f"rms_norm_scales: scales[{i}] has shape {tuple(s.shape)}, "
                              f"expected ({n},).",
                              "Pass one scale vector per output, as wide as the last dim of x, "
                              "or None.")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise KernelError(f"rms_norm_scales: residual {tuple(residual.shape)} {residual.dtype} "
                          f"must match x {tuple(x.shape)} {x.dtype}.",
                          "Pass a residual shaped and typed like x.")
    if not use_triton(backend, x, misfit(x, len(scales)), shape=("rms_norm", n, len(scales))):
        return rms_norm_scales_reference(x, scales, eps, residual)
    ys, h = fused_forward(x, residual, scales, 1, eps)
    return tuple(ys) if residual is None else (*ys, h)


def misfit(x: Tensor, k: int) -> str | None:
    """Why K outputs of rows of x do not fit the fused kernels; None when they do."""
    n = x.shape[-1]
    if k <= MAX_SCALES and n <= MAX_FEATURES and x.dtype in _DTYPES:
        return None
    return (f"the fused kernels take up to {MAX_SCALES} outputs of rows of up to {MAX_FEATURES} "
            f"features in {', '.join(map(str, _DTYPES))}; got {k} outputs of {n} features in "
            f"{x.dtype}.")


if triton is not None:

    @triton.jit
    def _fwd_kernel(X, R, H, RSTD, Y0, Y1, Y2, Y3, S0, S1, S2, S3, M, N, G, eps,
                    K: tl.constexpr, SCALED: tl.constexpr, HAS_RES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # One tile of BLOCK_M whole rows: read once, reduce in fp32, write K scaled copies.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_RES:
            # h is rounded to x's dtype before the norm, as x + residual in PyTorch is.
            x = (x.to(tl.float32)
                 + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(H + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        normed = xf * rstd[:, None]
        # The K outputs unrolled at compile time (static_range; a jit helper call would instead cost
        # the interpreter a re-patch of triton.language per call, which dominates the CPU test
        # time).
        s_offs = ((rows % G) * N)[:, None] + cols[None, :]
        ys, ss = (Y0, Y1, Y2, Y3), (S0, S1, S2, S3)
        for k in tl.static_range(K):
            y = normed
            if (SCALED >> k) & 1:
                y = normed * tl.load(ss[k] + s_offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ys[k] + offs, y.to(ys[k].dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_kernel(X, RSTD, DH, DX, DY0, DY1, DY2, DY3, S0, S1, S2, S3, DS, T, N, G, C,
                    K: tl.constexpr, SCALED: tl.constexpr, HAS_DH: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr):
        # Persistent: program (c, g) walks every C-th tile of the rows whose scale row is g, so its
        # scale-gradient partials belong to one scale row and need no atomics. DS is [C, K, G, N].
        pid = tl.program_id(0)
        g = pid % G
        c = pid // G
        cols = tl.arange(0, BLOCK_N)
        part = DS + (c * K * G + g) * N
        if CHUNKED:
            # Rows longer than a tile: per tile of rows, one pass over the column chunks for the row
            # reduction, a second (re-reading the chunks, mostly from cache) for dx, adding each
            # chunk's scale-gradient sums into the program's own partials (written by its first
            # tile: every program has one, the caller launches at most a program per tile).
            for t0 in range(c * BLOCK_M, T, C * BLOCK_M):
                tokens = (t0 + tl.arange(0, BLOCK_M)).to(tl.int64)
                row_ok = tokens < T
                rows = tokens * G + g
                rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
                proj = tl.zeros([BLOCK_M], tl.float32)
                for n0 in range(0, N, BLOCK_N):
                    normed, dn, _, _, _, _ = _bwd_chunk(X, DY0, DY1, DY2, DY3, S0, S1, S2, S3, rows,
                                                        row_ok, rstd, n0 + cols, N, g, K, SCALED)
                    proj += tl.sum(dn * normed, axis=1)
                proj = proj / N
                for n0 in range(0, N, BLOCK_N):
                    chunk = n0 + cols
                    mask = row_ok[:, None] & (chunk < N)[None, :]
                    offs = rows[:, None] * N + chunk[None, :]
                    # Issued with the chunk's other loads (before any arithmetic waits for them).
                    if HAS_DH:
                        dh = tl.load(DH + offs, mask=mask, other=0.0)
                    normed, dn, dy0, dy1, dy2, dy3 = _bwd_chunk(
                        X, DY0, DY1, DY2, DY3, S0, S1, S2, S3, rows, row_ok, rstd, chunk, N, g, K,
                        SCALED)
                    dx = (dn - normed * proj[:, None]) * rstd[:, None]
                    if HAS_DH:
                        dx += dh.to(tl.float32)
                    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
                    dys = (dy0, dy1, dy2, dy3)
                    # The partials an earlier tile wrote (a mask of the chunk's shape: triton's
                    # interpreter takes no scalar in one)
                    earlier = (chunk < N) & (t0 + 0 * chunk > c * BLOCK_M)
                    for k in tl.static_range(K):
                        if (SCALED >> k) & 1:
                            p = part + k * G * N + chunk
                            total = (tl.load(p, mask=earlier, other=0.0)
                                     + tl.sum(dys[k] * normed, axis=0))
                            tl.store(p, total, mask=chunk < N)
                # The next tile's threads may read partials other threads of this program wrote.
                tl.debug_barrier()
        else:
            col_ok = cols < N
            s_offs = g * N + cols
            # Unscaled slots multiply by 1 (folded away by the compiler).
            s0 = tl.full([BLOCK_N], 1.0, tl.float32)
            s1 = tl.full([BLOCK_N], 1.0, tl.float32)
            s2 = tl.full([BLOCK_N], 1.0, tl.float32)
            s3 = tl.full([BLOCK_N], 1.0, tl.float32)
            if SCALED & 1:
                s0 = tl.load(S0 + s_offs, mask=col_ok, other=0.0).to(tl.float32)
            if (SCALED >> 1) & 1:
                s1 = tl.load(S1 + s_offs, mask=col_ok, other=0.0).to(tl.float32)
            if (SCALED >> 2) & 1:
                s2 = tl.load(S2 + s_offs, mask=col_ok, other=0.0).to(tl.float32)
            if (SCALED >> 3) & 1:
                s3 = tl.load(S3 + s_offs, mask=col_ok, other=0.0).to(tl.float32)
            acc0 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for t0 in range(c * BLOCK_M, T, C * BLOCK_M):
                tokens = (t0 + tl.arange(0, BLOCK_M)).to(tl.int64)
                row_ok = tokens < T
                rows = tokens * G + g
                mask = row_ok[:, None] & col_ok[None, :]
                offs = rows[:, None] * N + cols[None, :]
                # Every large load of the tile first, then the arithmetic: the warp has them all in
                # flight before it first waits (traffic.py counts what it has).
                rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
                x = tl.load(X + offs, mask=mask, other=0.0)
                dy0 = tl.load(DY0 + offs, mask=mask, other=0.0)
                if K > 1:
                    dy1 = tl.load(DY1 + offs, mask=mask, other=0.0)
                if K > 2:
                    dy2 = tl.load(DY2 + offs, mask=mask, other=0.0)
                if K > 3:
                    dy3 = tl.load(DY3 + offs, mask=mask, other=0.0)
                if HAS_DH:
                    dh = tl.load(DH + offs, mask=mask, other=0.0)
                normed = x.to(tl.float32) * rstd[:, None]
                dy = dy0.to(tl.float32)
                dn = dy * s0[None, :]
                acc0 += dy * normed
                if K > 1:
                    dy = dy1.to(tl.float32)
                    dn += dy * s1[None, :]
                    acc1 += dy * normed
                if K > 2:
                    dy = dy2.to(tl.float32)
                    dn += dy * s2[None, :]
                    acc2 += dy * normed
                if K > 3:
                    dy = dy3.to(tl.float32)
                    dn += dy * s3[None, :]
                    acc3 += dy * normed
                proj = tl.sum(dn * normed, axis=1) / N
                dx = (dn - normed * proj[:, None]) * rstd[:, None]
                if HAS_DH:
                    dx += dh.to(tl.float32)
                tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            accs = (acc0, acc1, acc2, acc3)
            for k in tl.static_range(K):
                if (SCALED >> k) & 1:
                    tl.store(part + k * G * N + cols, tl.sum(accs[k], axis=0), mask=col_ok)

    @triton.jit
    def _bwd_chunk(X, DY0, DY1, DY2, DY3, S0, S1, S2, S3, rows, row_ok, rstd, chunk, N, g,
                   K: tl.constexpr, SCALED: tl.constexpr):
        """(normed, dn, dy_0..3) of a chunk of columns: dn = sum_k s_k dy_k; absent dy_k are
        zeros."""
        col_ok = chunk < N
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * N + chunk[None, :]
        # The chunk's large loads first, then the arithmetic (as in the whole-row path).
        x = tl.load(X + offs, mask=mask, other=0.0)
        dy0 = tl.load(DY0 + offs, mask=mask, other=0.0).to(tl.float32)
        normed = tl.zeros_like(dy0)
        dy1 = normed
        dy2 = normed
        dy3 = normed
        if K > 1:
            dy1 = tl.load(DY1 + offs, mask=mask, other=0.0).to(tl.float32)
        if K > 2:
            dy2 = tl.load(DY2 + offs, mask=mask, other=0.0).to(tl.float32)
        if K > 3:
            dy3 = tl.load(DY3 + offs, mask=mask, other=0.0).to(tl.float32)
        normed = x.to(tl.float32) * rstd[:, None]
        dys = (dy0, dy1, dy2, dy3)
        ss = (S0, S1, S2, S3)
        dn = tl.zeros_like(normed)
        for k in tl.static_range(K):
            dy = dys[k]
            if (SCALED >> k) & 1:
                dy = dy * tl.load(ss[k] + g * N + chunk, mask=col_ok,
                                  other=0.0).to(tl.float32)[None, :]
            dn += dy
        return normed, dn, dy0, dy1, dy2, dy3


# Elements per forward tile (whole rows); a backward's tile and widest chunk (None: by the in-flight
# rule, backend.backward_tile; longer rows are walked in chunks). The interpreter pays per
# operation, not per element: larger tiles keep the CPU tests fast (and tests force small chunks to
# run the chunked path).
_FWD_TILE, _BWD_TILE = (65536, 65536) if INTERPRETED else (4096, None)
_BWD_CHUNK = None
# Registers within which the kernels compile without a spill on every tile the presets launch
# (sm_90, dev/kernel_table.py): the forward on at least 40 on a tile of one row, 48 on several
# (their rows' offsets and statistics: a tile of 4 rows with K = 3 outputs spilled at 40), the
# backward at up to 32 elements a thread
FORWARD_LEAST_REGISTERS, FORWARD_LEAST_REGISTERS_ROWS, BACKWARD_WIDEST = (40, 48,
                                                                          4 * BACKWARD_PER_THREAD)


def backward_grid(n: int, tokens: int, groups: int, row_bytes: int, touched: int, residual: bool,
                  device: torch.device) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per scale row, chunked) of the backward, whose loads
    of x and the K output gradients take `row_bytes` per element (the residual's gradient is left
    out: the chunked path every backward with one takes reads it in its second pass only, so the
    first pass's loads are the fewer), and all its large tensors `touched` (backend.backward_tile);
    each program writes one fp32 partial per scale gradient. Tiles of more than
    BACKWARD_PER_THREAD elements a thread, and every backward with a residual's gradient, take the
    chunked path even when one chunk holds the row: without the K [BLOCK_M, BLOCK_N] accumulators
    ptxas issues all of a tile's loads before it waits (with them, it left the residual's load
    behind the arithmetic: a warp then had one tensor in flight)."""
    block_m, block_n, warps, per_thread = backward_tile(n, row_bytes, touched, BACKWARD_WIDEST,
                                                        _BWD_CHUNK)
    if _BWD_TILE:
        block_m, block_n, warps = chunked_tile(n, _BWD_TILE, per_thread, _BWD_CHUNK)
    programs = triton.cdiv(resident_programs(device, warps), groups)
    chunked = block_n < n or per_thread > BACKWARD_PER_THREAD or residual
    return block_m, block_n, warps, max(1, min(triton.cdiv(tokens, block_m), programs)), chunked


def _by_slot(scales: list[Tensor], scaled: list[bool]) -> list[Tensor | None]:
    """The present scales spread over the K output slots, None where an output is unscaled."""
    present = iter(s.contiguous() for s in scales)
    return [next(present) if on else None for on in scaled]


def _mask(scaled: list[bool]) -> int:
    return sum(1 << i for i, on in enumerate(scaled) if on)


def fused_forward(x: Tensor, residual: Tensor | None, scales: list[Tensor | None], groups: int,
                  eps: float) -> tuple[list[Tensor], Tensor]:
    """Run the fused op: (ys, h), h empty without a residual. Row r uses scale row r % groups."""
    # The op takes only the present scales (plus which outputs they scale): autograd routes
    # gradients into a list argument only when every entry is a tensor.
    present = [s for s in scales if s is not None]
    ys, h, _ = torch.ops.scalevec.rms_norm_fwd(x, residual, present,
                                               [s is not None for s in scales], groups, eps)
    return ys, h


_FWD_SCHEMA = ("(Tensor x, Tensor? residual, Tensor[] scales, bool[] scaled, int groups, float eps)"
               " -> (Tensor[], Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor[] grad_ys, Tensor? grad_h, Tensor x, Tensor rstd, Tensor[] scales,"
               " bool[] scaled, int groups) -> (Tensor, Tensor[])")


@torch.library.custom_op("scalevec::rms_norm_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def _fwd_op(x, residual, scales, scaled, groups, eps):
    """(ys, h, rstd): y_k for each entry of `scaled`, h = x + residual (empty without one), and the
    fp32 inverse RMS per row. scales[i] scales the i-th output whose `scaled` entry is true."""
    x = x.contiguous()
    ys, h, rstd = _fwd_fake(x, residual, scales, scaled, groups, eps)
    n = x.shape[-1]
    m = x.numel() // n
    if m == 0:
        return ys, h, rstd
    block_m, block_n, warps = tile(n, _FWD_TILE)
    row_bytes = x.element_size() * (1 if residual is None else 2)
    res = x if residual is None else residual.contiguous()
    _fwd_kernel[(triton.cdiv(m, block_m),)](
        x, res, h if residual is not None else x, rstd, *pointer_slots(ys, ys[0], MAX_SCALES),
        *pointer_slots(_by_slot(scales, scaled), x, MAX_SCALES), m, n, groups, eps, K=len(scaled),
        SCALED=_mask(scaled), HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps,
        maxnreg=forward_registers(n, block_m, block_n, warps, row_bytes,
                                  FORWARD_LEAST_REGISTERS if block_m == 1
                                  else FORWARD_LEAST_REGISTERS_ROWS))
    return ys, h, rstd


@_fwd_op.register_fake
def _fwd_fake(x, residual, scales, scaled, groups, eps):
    def like_x():
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    h = like_x() if residual is not None else torch.empty(0, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    return [like_x() for _ in scaled], h, rstd


@torch.library.custom_op("scalevec::rms_norm_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def _bwd_op(grad_ys, grad_h, x, rstd, scales, scaled, groups):
    """(dx, [ds_i]): one gradient per entry of `scales`, in its dtype and shape. x is the normalized
    input (h when the forward had a residual); grad_h, if given, is added to dx."""
    dx, ds = _bwd_fake(grad_ys, grad_h, x, rstd, scales, scaled, groups)
    n = x.shape[-1]
    tokens = x.numel() // n // groups
    if tokens == 0:
        return dx, [d.zero_() for d in ds]
    row_bytes = x.element_size() + sum(g.element_size() for g in grad_ys)
    touched = row_bytes + dx.element_size() + (0 if grad_h is None else grad_h.element_size())
    block_m, block_n, warps, programs, chunked = backward_grid(n, tokens, groups, row_bytes,
                                                               touched, grad_h is not None,
                                                               x.device)
    partials = torch.empty((programs, len(grad_ys), groups, n), dtype=torch.float32,
                           device=x.device)
    dh = x if grad_h is None else grad_h.contiguous()
    _bwd_kernel[(programs * groups,)](
        x.contiguous(), rstd.contiguous(), dh, dx,
        *pointer_slots([g.contiguous() for g in grad_ys], x, MAX_SCALES),
        *pointer_slots(_by_slot(scales, scaled), x, MAX_SCALES), partials, tokens, n, groups,
        programs, K=len(scaled), SCALED=_mask(scaled), HAS_DH=grad_h is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, CHUNKED=chunked, num_warps=warps, maxnreg=MAX_REGISTERS)
    reduce_partials(partials, _by_slot(ds, scaled), [False] * len(scaled))
    return dx, ds


@_bwd_op.register_fake
def _bwd_fake(grad_ys, grad_h, x, rstd, scales, scaled, groups):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return dx, [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in scales]


def _setup_context(ctx, inputs, output):
    x, residual, scales, scaled, groups, _ = inputs
    _, h, rstd = output
    ctx.has_residual, ctx.scaled, ctx.groups = residual is not None, scaled, groups
    # rstd's gradient (and an unused output's) stays None: no zeros are made for it
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x if residual is None else h, rstd, *scales)


def _backward(ctx, grad_ys, grad_h, _grad_rstd):
    normed_input, rstd, *scales = ctx.saved_tensors
    grad_ys = [torch.zeros_like(normed_input) if g is None else g for g in grad_ys]
    grad_h = grad_h if ctx.has_residual else None
    dx, ds = torch.ops.scalevec.rms_norm_bwd(grad_ys, grad_h, normed_input, rstd, scales,
                                             ctx.scaled, ctx.groups)
    return dx, dx if ctx.has_residual else None, ds, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)

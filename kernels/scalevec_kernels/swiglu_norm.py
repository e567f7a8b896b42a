"""Fused normalization + SwiGLU: out = silu(u_g * N(G)) * (u_u * N(U)),
N(x) = x / sqrt(mean(x^2) + eps).

Under the `unified` strategy the FFN normalizes its gate and up pre-activations G, U over the hidden
width, each with its own output scale, before the SwiGLU product. Unfused, that is two norms writing
scaled copies, then silu and the product reading them back: about nine row transfers. Fused, the
forward reads G and U once and writes the output (three), keeping two fp32 inverse RMS per row; the
backward reads G, U and the output gradient, recomputes the normalized rows, and writes dG and dU
(five). Rows wider than the backward's widest tile (4096 features) are walked in chunks, as in
rms_norm.py.

A scale is shared by every row ([F]), or is per expert ([E, F]) for the rows of a MoE layer grouped
by expert: `expert_offsets` [E] holds the cumulative row counts, and row r uses the scale row of the
expert whose range [offsets[e-1], offsets[e]) contains it.

This file holds the Triton kernels, the `scalevec::swiglu_norm_fwd/bwd` ops with their fake
implementations and autograd wiring, and the plain PyTorch reference.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import (
    BACKWARD_PER_THREAD,
    INTERPRETED,
    MAX_REGISTERS,
    MAX_WARPS,
    backward_tile,
    chunked_tile,
    forward_registers,
    resident_programs,
    tl,
    triton,
    use_triton,
)
from .errors import KernelError
from .partials import reduce_partials

# The widest rows the kernels take; the forward holds FORWARD_PER_THREAD elements of G and of U a
# thread
MAX_FEATURES, FORWARD_PER_THREAD = 16384, 16
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernels' [rows, F] arguments: the large tensors the memory model counts
# (dev/kernel_tools/traffic.py)
ROW_ARGS = {"_fwd_kernel": ("G", "U", "OUT"), "_bwd_kernel": ("DOUT", "G", "U", "DG", "DU")}


def swiglu_norm_reference(gate: Tensor, up: Tensor, gate_scale: Tensor | None,
                          up_scale: Tensor | None, eps: float,
                          expert_offsets: Tensor | None = None) -> Tensor:
    """Plain PyTorch: the op sequence of the model's unfused path, so its results bit for bit."""
    # fp32, as .float() gives, for the model's fp32/bf16/fp16; float64 stays float64
    # (for gradcheck).
    compute = torch.promote_types(gate.dtype, torch.float32)

    def scaled_norm(x: Tensor, s: Tensor | None) -> Tensor:
        xf = x.to(compute)
        n = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        if s is not None:
            n = n * _scale_rows(s, x, expert_offsets).to(compute)
        return n.to(x.dtype)

    return F.silu(scaled_norm(gate, gate_scale)) * scaled_norm(up, up_scale)


def _scale_rows(s: Tensor, x: Tensor, offsets: Tensor | None) -> Tensor:
    """A shared scale as it is; a per-expert one as each row's expert row, shaped like x."""
    if s.dim() == 1:
        return s
    rows = torch.arange(x.shape[:-1].numel(), device=offsets.device, dtype=offsets.dtype)
    # The number of offsets at or below r; rows past the last offset count as the last expert, as in
    # the kernels.
    expert = torch.searchsorted(offsets, rows, right=True).clamp_(max=s.shape[0] - 1)
    return s.index_select(0, expert).view(x.shape)


def swiglu_norm(gate: Tensor, up: Tensor, gate_scale: Tensor | None, up_scale: Tensor | None,
                eps: float, expert_offsets: Tensor | None = None, backend: str = "auto") -> Tensor:
    """silu(u_g * N(gate)) * (u_u * N(up)) over the last dim, in gate's dtype
    (see the module docstring)."""
    _check(gate, up, gate_scale, up_scale, expert_offsets)
    per_expert = any(s is not None and s.dim() == 2 for s in (gate_scale, up_scale))
    shape = ("swiglu_norm", gate.shape[-1], 1, expert_offsets.numel() if per_expert else 0)
    if not use_triton(backend, gate, _misfit(gate, gate_scale, up_scale), shape=shape):
        return swiglu_norm_reference(gate, up, gate_scale, up_scale, eps, expert_offsets)
    out, _ = torch.ops.scalevec.swiglu_norm_fwd(gate, up, gate_scale, up_scale,
                                                expert_offsets if per_expert else None, eps)
    return out


def _check(gate: Tensor, up: Tensor, gate_scale: Tensor | None, up_scale: Tensor | None,
           offsets: Tensor | None) -> None:
    if gate.dim() < 1 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise KernelError(f"swiglu_norm: gate {tuple(gate.shape)} {gate.dtype} and up "
                          f"{tuple(up.shape)} {up.dtype} differ.",
                          "Pass gate and up pre-activations [..., F] of one shape and dtype.")
    if offsets is not None and (offsets.dim() != 1 or offsets.numel() == 0
                                or offsets.device != gate.device
                                or offsets.dtype not in (torch.int32, torch.int64)):
        raise KernelError(f"swiglu_norm: expert_offsets has shape {tuple(offsets.shape)}, "
                          f"{offsets.dtype}, on {offsets.device}; expected [E >= 1] int32 or int64 "
                          f"on {gate.device}.",
                          "Pass the cumulative row counts of the experts, e.g. counts.cumsum(0).")
    f = gate.shape[-1]
    for name, s in (("gate_scale", gate_scale), ("up_scale", up_scale)):
        if (s is None or s.shape == (f,)
                or (offsets is not None and s.shape == (offsets.numel(), f))):
            continue
        expected = f"({f},)" if offsets is None else f"({f},) or ({offsets.numel()}, {f})"
        raise KernelError(f"swiglu_norm: {name} has shape {tuple(s.shape)}, expected {expected}.",
                          "Pass a scale shared by every row, one row per expert together with "
                          "expert_offsets, or None.")


def _misfit(gate: Tensor, *scales: Tensor | None) -> str | None:
    """Why a call does not fit the fused kernels; None when it does."""
    dtypes = [gate.dtype] + [s.dtype for s in scales if s is not None]
    if gate.shape[-1] <= MAX_FEATURES and all(d in _DTYPES for d in dtypes):
        return None
    return (f"the fused kernels take rows of up to {MAX_FEATURES} features, inputs and scales in "
            f"{', '.join(map(str, _DTYPES))}; got {gate.shape[-1]} features in "
            f"{', '.join(map(str, dtypes))}.")


if triton is not None:

    @triton.jit
    def _fwd_kernel(G, U, OUT, RSTD, SG, SU, OFFS, M, N, E, eps,
                    SCALED: tl.constexpr, PER_EXPERT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                    CHUNKED: tl.constexpr):
        # One tile of BLOCK_M rows: G and U read once, statistics in fp32, one write of the output.
        # Rows wider than a tile (CHUNKED) are walked twice, chunk by chunk: the sums of squares,
        # then the output, re-reading the chunks from L2. Bit 0 of SCALED / PER_EXPERT stands for
        # the gate's scale, bit 1 for the up's. RSTD is [2, M].
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < M
        row_offs = rows.to(tl.int64)[:, None] * N
        scale_row = tl.zeros([BLOCK_M], tl.int32)
        if PER_EXPERT:
            # A row's expert is the number of offsets at or below it; rows past the last offset (a
            # bad argument) take the last expert's scale rather than read out of bounds.
            for e0 in range(0, E, BLOCK_E):
                es = e0 + tl.arange(0, BLOCK_E)
                ends = tl.load(OFFS + es, mask=es < E, other=M)
                scale_row += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
            scale_row = tl.minimum(scale_row, E - 1) * N
        if CHUNKED:
            sum_g = tl.zeros([BLOCK_M], tl.float32)
            sum_u = tl.zeros([BLOCK_M], tl.float32)
            for n0 in range(0, N, BLOCK_N):
                mask = row_ok[:, None] & (n0 + cols < N)[None, :]
                g = tl.load(G + row_offs + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                u = tl.load(U + row_offs + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sum_g += tl.sum(g * g, axis=1)
                sum_u += tl.sum(u * u, axis=1)
            rstd_g = tl.rsqrt(sum_g / N + eps)
            rstd_u = tl.rsqrt(sum_u / N + eps)
            for n0 in range(0, N, BLOCK_N):
                _fwd_chunk(G, U, OUT, SG, SU, rows, row_ok, row_offs, scale_row, n0 + cols, N,
                           rstd_g, rstd_u, SCALED, PER_EXPERT)
        else:
            mask = row_ok[:, None] & (cols < N)[None, :]
            g = tl.load(G + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(U + row_offs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd_g = tl.rsqrt(tl.sum(g * g, axis=1) / N + eps)
            rstd_u = tl.rsqrt(tl.sum(u * u, axis=1) / N + eps)
            tl.store(OUT + row_offs + cols[None, :],
                     _swiglu(g, u, rstd_g, rstd_u, SG, SU, scale_row, cols, N, mask, SCALED,
                             PER_EXPERT).to(OUT.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd_g, mask=row_ok)
        tl.store(RSTD + M + rows, rstd_u, mask=row_ok)

    @triton.jit
    def _fwd_chunk(G, U, OUT, SG, SU, rows, row_ok, row_offs, scale_row, chunk, N, rstd_g, rstd_u,
                   SCALED: tl.constexpr, PER_EXPERT: tl.constexpr):
        """The output of one chunk of columns, from G and U read again."""
        mask = row_ok[:, None] & (chunk < N)[None, :]
        g = tl.load(G + row_offs + chunk[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row_offs + chunk[None, :], mask=mask, other=0.0).to(tl.float32)
        out = _swiglu(g, u, rstd_g, rstd_u, SG, SU, scale_row, chunk, N, mask, SCALED, PER_EXPERT)
        tl.store(OUT + row_offs + chunk[None, :], out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu(g, u, rstd_g, rstd_u, SG, SU, scale_row, cols, N, mask,
                SCALED: tl.constexpr, PER_EXPERT: tl.constexpr):
        """silu(s_g N(g)) * s_u N(u) in fp32, for the columns `cols` of rows whose scale row starts
        at `scale_row` (per expert) or of the shared scales."""
        a = g * rstd_g[:, None]
        b = u * rstd_u[:, None]
        col_ok = cols < N
        s_offs = scale_row[:, None] + cols[None, :]
        if SCALED & 1:
            if PER_EXPERT & 1:
                a = a * tl.load(SG + s_offs, mask=mask, other=0.0).to(tl.float32)
            else:
                a = a * tl.load(SG + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SCALED & 2:
            if PER_EXPERT & 2:
                b = b * tl.load(SU + s_offs, mask=mask, other=0.0).to(tl.float32)
            else:
                b = b * tl.load(SU + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # Rounded once, from fp32: the reference rounds the scaled norms and the silu as well.
        return a * tl.sigmoid(a) * b

    @triton.jit
    def _bwd_kernel(DOUT, G, U, RSTD, SG, SU, OFFS, DG, DU, DS, M, N, E, C,
                    SCALED: tl.constexpr, PER_EXPERT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr):
        # Persistent: program (c, e) walks every C-th tile of expert e's rows (all rows when E = 1),
        # so its scale-gradient partials belong to one expert and need no atomics. DS is
        # [C, 2, E, N].
        pid = tl.program_id(0)
        e = pid % E
        c = pid // E
        cols = tl.arange(0, BLOCK_N)
        start = 0
        end = M
        if PER_EXPERT:
            start = tl.load(OFFS + e - 1, mask=e > 0, other=0).to(tl.int32)
            # The last expert also takes rows past its offset, as in the forward.
            end = tl.where(e == E - 1, M, tl.minimum(tl.load(OFFS + e), M).to(tl.int32))
        sg_row = e * N if PER_EXPERT & 1 else 0
        su_row = e * N if PER_EXPERT & 2 else 0
        part = DS + (c * 2 * E + e) * N
        if CHUNKED:
            # Rows longer than a tile: per tile of rows, one pass over the column chunks for the two
            # row reductions, a second (re-reading the chunks, mostly from cache) for dG and dU,
            # adding each chunk's scale-gradient sums into the program's own partials, which its
            # first tile writes (a program of an expert with fewer tiles than programs has none: it
            # writes zeros).
            first = start + c * BLOCK_M
            if first >= end:
                for n0 in range(0, N, BLOCK_N):
                    chunk = n0 + cols
                    if SCALED & 1:
                        tl.store(part + chunk, tl.zeros([BLOCK_N], tl.float32), mask=chunk < N)
                    if SCALED & 2:
                        tl.store(part + E * N + chunk, tl.zeros([BLOCK_N], tl.float32),
                                 mask=chunk < N)
            for t0 in range(first, end, C * BLOCK_M):
                rows = t0 + tl.arange(0, BLOCK_M)
                row_ok = rows < end
                rstd_g = tl.load(RSTD + rows, mask=row_ok, other=0.0)
                rstd_u = tl.load(RSTD + M + rows, mask=row_ok, other=0.0)
                proj_g = tl.zeros([BLOCK_M], tl.float32)
                proj_u = tl.zeros([BLOCK_M], tl.float32)
                for n0 in range(0, N, BLOCK_N):
                    n_g, n_u, da, db, s_g, s_u = _bwd_chunk(
                        DOUT, G, U, SG + sg_row, SU + su_row, rows, row_ok, rstd_g, rstd_u,
                        n0 + cols, N, SCALED, BLOCK_N)
                    proj_g += tl.sum(da * s_g[None, :] * n_g, axis=1)
                    proj_u += tl.sum(db * s_u[None, :] * n_u, axis=1)
                proj_g = proj_g / N
                proj_u = proj_u / N
                for n0 in range(0, N, BLOCK_N):
                    chunk = n0 + cols
                    n_g, n_u, da, db, s_g, s_u = _bwd_chunk(
                        DOUT, G, U, SG + sg_row, SU + su_row, rows, row_ok, rstd_g, rstd_u, chunk,
                        N, SCALED, BLOCK_N)
                    mask = row_ok[:, None] & (chunk < N)[None, :]
                    offs = rows.to(tl.int64)[:, None] * N + chunk[None, :]
                    dg = (da * s_g[None, :] - n_g * proj_g[:, None]) * rstd_g[:, None]
                    du = (db * s_u[None, :] - n_u * proj_u[:, None]) * rstd_u[:, None]
                    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
                    tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
                    # Onto the partials an earlier tile wrote: a branch, not a mask of the chunk's
                    # shape, whose predicates made ptxas spill at 4096 features
                    if SCALED & 1:
                        p = part + chunk
                        s = tl.sum(da * n_g, axis=0)
                        if t0 > first:
                            s += tl.load(p, mask=chunk < N, other=0.0)
                        tl.store(p, s, mask=chunk < N)
                    if SCALED & 2:
                        p = part + E * N + chunk
                        s = tl.sum(db * n_u, axis=0)
                        if t0 > first:
                            s += tl.load(p, mask=chunk < N, other=0.0)
                        tl.store(p, s, mask=chunk < N)
                # The next tile's threads may read partials other threads of this program wrote.
                tl.debug_barrier()
        else:
            col_ok = cols < N
            # Unscaled slots multiply by 1 (folded away by the compiler).
            s_g = tl.full([BLOCK_N], 1.0, tl.float32)
            s_u = tl.full([BLOCK_N], 1.0, tl.float32)
            if SCALED & 1:
                s_g = tl.load(SG + sg_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            if SCALED & 2:
                s_u = tl.load(SU + su_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for t0 in range(start + c * BLOCK_M, end, C * BLOCK_M):
                rows = t0 + tl.arange(0, BLOCK_M)
                row_ok = rows < end
                mask = row_ok[:, None] & col_ok[None, :]
                offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
                # The tile's large loads first, then the arithmetic (traffic.py counts what is in
                # flight).
                rstd_g = tl.load(RSTD + rows, mask=row_ok, other=0.0)
                rstd_u = tl.load(RSTD + M + rows, mask=row_ok, other=0.0)
                g = tl.load(G + offs, mask=mask, other=0.0)
                u = tl.load(U + offs, mask=mask, other=0.0)
                dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
                n_g = g.to(tl.float32) * rstd_g[:, None]
                n_u = u.to(tl.float32) * rstd_u[:, None]
                a = n_g * s_g[None, :]
                b = n_u * s_u[None, :]
                sig = tl.sigmoid(a)
                # silu'(a) = sig(a) (1 + a (1 - sig(a)))
                da = dout * b * sig * (1.0 + a * (1.0 - sig))
                db = dout * a * sig
                if SCALED & 1:
                    acc_g += da * n_g
                if SCALED & 2:
                    acc_u += db * n_u
                # Through the norm, with dn = s * d(s n): dx = rstd (dn - n mean(dn n)).
                dn_g = da * s_g[None, :]
                dn_u = db * s_u[None, :]
                dg = (dn_g - n_g * (tl.sum(dn_g * n_g, axis=1) / N)[:, None]) * rstd_g[:, None]
                du = (dn_u - n_u * (tl.sum(dn_u * n_u, axis=1) / N)[:, None]) * rstd_u[:, None]
                tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
                tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
            if SCALED & 1:
                tl.store(part + cols, tl.sum(acc_g, axis=0), mask=col_ok)
            if SCALED & 2:
                tl.store(part + E * N + cols, tl.sum(acc_u, axis=0), mask=col_ok)

    @triton.jit
    def _bwd_chunk(DOUT, G, U, SG, SU, rows, row_ok, rstd_g, rstd_u, chunk, N,
                   SCALED: tl.constexpr, BLOCK_N: tl.constexpr):
        """(n_g, n_u, da, db, s_g, s_u) of a chunk of columns: the normalized rows, the gradients of
        the scaled norms a = s_g n_g and b = s_u n_u, and the scales (ones where unscaled)."""
        col_ok = chunk < N
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * N + chunk[None, :]
        s_g = tl.full([BLOCK_N], 1.0, tl.float32)
        s_u = tl.full([BLOCK_N], 1.0, tl.float32)
        if SCALED & 1:
            s_g = tl.load(SG + chunk, mask=col_ok, other=0.0).to(tl.float32)
        if SCALED & 2:
            s_u = tl.load(SU + chunk, mask=col_ok, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0)
        u = tl.load(U + offs, mask=mask, other=0.0)
        dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
        n_g = g.to(tl.float32) * rstd_g[:, None]
        n_u = u.to(tl.float32) * rstd_u[:, None]
        a = n_g * s_g[None, :]
        b = n_u * s_u[None, :]
        sig = tl.sigmoid(a)
        # silu'(a) = sig(a) (1 + a (1 - sig(a)))
        da = dout * b * sig * (1.0 + a * (1.0 - sig))
        db = dout * a * sig
        return n_g, n_u, da, db, s_g, s_u


# Elements per tile, forward and backward (None: by the in-flight rule, backend.backward_tile), and
# the widest chunk (None: the tile's): rows wider are walked in chunks. The interpreter pays per
# operation, not per element: larger tiles keep the CPU tests fast (and tests force small chunks to
# run the chunked paths).
_FWD_TILE, _BWD_TILE = ((65536, 65536) if INTERPRETED
                        else (MAX_WARPS * 32 * FORWARD_PER_THREAD, None))
_CHUNK = None
# Registers within which the kernels compile without a spill on every tile the presets launch
# (sm_90, dev/kernel_table.py): the forward on at least 64, 80 with per-expert scales (their expert
# lookup; they spilled at 64), the backward at up to 16 elements a thread (32 spilled 264-392 B)
FORWARD_LEAST_REGISTERS, FORWARD_LEAST_REGISTERS_PER_EXPERT, BACKWARD_WIDEST = (
    64, 80, 2 * BACKWARD_PER_THREAD)


def forward_tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward: whole rows up to _FWD_TILE features, chunks
    beyond."""
    return chunked_tile(n, _FWD_TILE, FORWARD_PER_THREAD, _CHUNK)


def backward_grid(n: int, rows: int, experts: int, row_bytes: int, touched: int,
                  device: torch.device) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per expert, chunked) of the backward, whose large
    loads take `row_bytes` per element (G, U and the output's gradient), and all its large tensors
    `touched` (backend.backward_tile); each program writes one fp32 partial per scale gradient.
    Tiles of more than BACKWARD_PER_THREAD elements a thread take the chunked path even when one
    chunk holds the row: it keeps no [BLOCK_M, BLOCK_N] scale-gradient accumulators, which spilled
    at 16 a thread.

    An expert's rows are spread over this many programs whatever its share of the rows, so a very
    uneven routing leaves part of the device idle in the backward."""
    # A width that is no multiple of 16 (Triton then cannot assume aligned rows) takes more
    # registers for its addresses: at 16 elements a thread, 344 features spilled 48 B.
    widest = BACKWARD_WIDEST if n % 16 == 0 else BACKWARD_PER_THREAD
    block_m, block_n, warps, per_thread = backward_tile(n, row_bytes, touched, widest, _CHUNK)
    if _BWD_TILE:
        block_m, block_n, warps = chunked_tile(n, _BWD_TILE, per_thread, _CHUNK)
    programs = triton.cdiv(resident_programs(device, warps), experts)
    chunked = block_n < n or per_thread > BACKWARD_PER_THREAD
    return block_m, block_n, warps, max(1, min(triton.cdiv(rows, block_m), programs)), chunked


def _flags(gate_scale: Tensor | None, up_scale: Tensor | None) -> tuple[int, int]:
    """(SCALED, PER_EXPERT) bit masks of the kernels: bit 0 the gate's scale, bit 1 the up's."""
    scales = (gate_scale, up_scale)
    scaled = sum(1 << i for i, s in enumerate(scales) if s is not None)
    per_expert = sum(1 << i for i, s in enumerate(scales) if s is not None and s.dim() == 2)
    return scaled, per_expert


def _experts(offsets: Tensor | None, per_expert: int) -> int:
    """Experts in the kernels' view: offsets with only shared scales change nothing, so they are
    ignored."""
    return offsets.numel() if per_expert else 1


_FWD_SCHEMA = ("(Tensor gate, Tensor up, Tensor? gate_scale, Tensor? up_scale,"
               " Tensor? expert_offsets, float eps) -> (Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor grad, Tensor gate, Tensor up, Tensor rstd, Tensor? gate_scale,"
               " Tensor? up_scale, Tensor? expert_offsets) -> (Tensor, Tensor, Tensor[])")


@torch.library.custom_op("scalevec::swiglu_norm_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def _fwd_op(gate, up, gate_scale, up_scale, expert_offsets, eps):
    """(out, rstd): rstd [2, rows] holds the fp32 inverse RMS of each row of gate (0) and of up
    (1)."""
    out, rstd = _fwd_fake(gate, up, gate_scale, up_scale, expert_offsets, eps)
    m, n = rstd.shape[1], gate.shape[-1]
    if m == 0:
        return out, rstd
    scaled, per_expert = _flags(gate_scale, up_scale)
    experts = _experts(expert_offsets, per_expert)
    block_m, block_n, warps = forward_tile(n)
    gate = gate.contiguous()
    _fwd_kernel[(triton.cdiv(m, block_m),)](
        gate, up.contiguous(), out, rstd, *_pointers(gate_scale, up_scale, expert_offsets, gate),
        m, n, experts, eps, SCALED=scaled, PER_EXPERT=per_expert, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_E=min(128, triton.next_power_of_2(experts)), CHUNKED=block_n < n, num_warps=warps,
        maxnreg=forward_registers(n, block_m, block_n, warps,
                                  gate.element_size() + up.element_size(),
                                  FORWARD_LEAST_REGISTERS_PER_EXPERT if per_expert
                                  else FORWARD_LEAST_REGISTERS))
    return out, rstd


@_fwd_op.register_fake
def _fwd_fake(gate, up, gate_scale, up_scale, expert_offsets, eps):
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    # math.prod keeps a data-dependent row count (MoE rows grouped by expert, compiled) symbolic.
    return out, torch.empty((2, math.prod(gate.shape[:-1])), dtype=torch.float32,
                            device=gate.device)


def _pointers(gate_scale: Tensor | None, up_scale: Tensor | None, offsets: Tensor | None,
              fill: Tensor) -> list[Tensor]:
    """The kernels' SG, SU and OFFS arguments; absent ones point at `fill` and are never touched."""
    return [fill if t is None else t.contiguous() for t in (gate_scale, up_scale, offsets)]


@torch.library.custom_op("scalevec::swiglu_norm_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def _bwd_op(grad, gate, up, rstd, gate_scale, up_scale, expert_offsets):
    """(dgate, dup, [ds]): one gradient per present scale (gate's first), in its dtype and shape."""
    dg, du, ds = _bwd_fake(grad, gate, up, rstd, gate_scale, up_scale, expert_offsets)
    m, n = rstd.shape[1], gate.shape[-1]
    if m == 0:
        return dg, du, [d.zero_() for d in ds]
    scaled, per_expert = _flags(gate_scale, up_scale)
    experts = _experts(expert_offsets, per_expert)
    row_bytes = gate.element_size() + up.element_size() + grad.element_size()
    # dG and dU written in their dtypes
    touched = row_bytes + gate.element_size() + up.element_size()
    block_m, block_n, warps, programs, chunked = backward_grid(n, m, experts, row_bytes, touched,
                                                               gate.device)
    partials = torch.empty((programs, 2, experts, n), dtype=torch.float32, device=gate.device)
    gate = gate.contiguous()
    _bwd_kernel[(programs * experts,)](
        grad.contiguous(), gate, up.contiguous(), rstd,
        *_pointers(gate_scale, up_scale, expert_offsets, gate), dg, du, partials, m, n, experts,
        programs, SCALED=scaled, PER_EXPERT=per_expert, BLOCK_M=block_m, BLOCK_N=block_n,
        CHUNKED=chunked, num_warps=warps, maxnreg=MAX_REGISTERS)
    # A shared scale's gradient also sums over the experts.
    present = iter(ds)
    slots = [None if s is None else next(present) for s in (gate_scale, up_scale)]
    reduce_partials(partials, slots,
                    [s is not None and s.dim() == 1 for s in (gate_scale, up_scale)])
    return dg, du, ds


@_bwd_op.register_fake
def _bwd_fake(grad, gate, up, rstd, gate_scale, up_scale, expert_offsets):
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    scales = [s for s in (gate_scale, up_scale) if s is not None]
    return dg, du, [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in scales]


def _setup_context(ctx, inputs, output):
    gate, up, gate_scale, up_scale, expert_offsets, _ = inputs
    ctx.save_for_backward(gate, up, output[1], gate_scale, up_scale, expert_offsets)
    ctx.set_materialize_grads(False)  # rstd's gradient stays None: no zeros are made for it


def _backward(ctx, grad, _grad_rstd):
    gate, up, rstd, gate_scale, up_scale, expert_offsets = ctx.saved_tensors
    dg, du, ds = torch.ops.scalevec.swiglu_norm_bwd(grad, gate, up, rstd, gate_scale, up_scale,
                                                    expert_offsets)
    ds = iter(ds)
    d_gate_scale = None if gate_scale is None else next(ds)
    d_up_scale = None if up_scale is None else next(ds)
    return dg, du, d_gate_scale, d_up_scale, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)

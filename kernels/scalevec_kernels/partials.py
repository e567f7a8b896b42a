"""The scale gradients from a backward's per-program partial sums, in one small kernel launch.

A backward's persistent programs each sum their own rows' share of every scale gradient into a
partials buffer DS [C, K, E, N] (C programs per scale row, K scale slots, E scale rows: heads or
experts, N features), so that no two programs add into one address. `reduce_partials` sums the C
programs' rows in a fixed order (deterministic from call to call), and, for a slot whose scale is
shared by the E rows (a shared scale of a per-expert SwiGLU backward), the E rows too, and writes
each slot's gradient in its scale's dtype: no torch op runs between the backward's launch and this
one.
"""

from .backend import pointer_slots, tl, triton

MAX_SLOTS = 4
# A program sums BLOCK_L columns (128 B of each partial row), BLOCK_C partial rows at a time: at the
# presets' widths (N >= 1024) a backward's C = 2 x 132 programs' partials take tens of programs a
# few steps each.
BLOCK_C, BLOCK_L, WARPS = 128, 32, 4


if triton is not None:

    @triton.jit
    def _reduce_kernel(DS, O0, O1, O2, O3, C, E, N,
                       K: tl.constexpr, SLOTS: tl.constexpr, SUM_E: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr):
        # Slot k (bit k of SLOTS) writes O_k: [E, N] summed over the C programs, or [N] summed over
        # the C programs and the E rows (bit k of SUM_E). Program p takes columns [p * BLOCK_L,
        # (p + 1) * BLOCK_L).
        cols = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        outs = (O0, O1, O2, O3)
        for k in tl.static_range(K):
            if (SLOTS >> k) & 1:
                if (SUM_E >> k) & 1:
                    width = N
                    rows = C * E
                else:
                    width = E * N
                    rows = C
                acc = tl.zeros([BLOCK_C, BLOCK_L], tl.float32)
                for r0 in range(0, rows, BLOCK_C):
                    r = r0 + tl.arange(0, BLOCK_C)
                    if (SUM_E >> k) & 1:
                        # row r is program r // E's partials of scale row r % E
                        base = ((r // E) * K * E + k * E + r % E).to(tl.int64) * N
                    else:
                        base = (r * K + k).to(tl.int64) * E * N
                    mask = (r < rows)[:, None] & (cols < width)[None, :]
                    acc += tl.load(DS + base[:, None] + cols[None, :], mask=mask, other=0.0)
                out = outs[k]
                tl.store(out + cols, tl.sum(acc, axis=0).to(out.dtype.element_ty),
                         mask=cols < width)


def reduce_partials(partials, outs: list, sum_e: list[bool]) -> None:
    """Write outs[k] (None: slot k has no scale) from partials [C, K, E, N] (fp32, contiguous): over
    the C programs, and over the E rows where sum_e[k]."""
    c, k, e, n = partials.shape
    slots = sum(1 << i for i, o in enumerate(outs) if o is not None)
    if not slots:
        return
    fill = next(o for o in outs if o is not None)
    _reduce_kernel[(triton.cdiv(e * n, BLOCK_L),)](
        partials, *pointer_slots(outs, fill, MAX_SLOTS), c, e, n, K=k, SLOTS=slots,
        SUM_E=sum(1 << i for i, s in enumerate(sum_e) if s), BLOCK_C=BLOCK_C, BLOCK_L=BLOCK_L,
        num_warps=WARPS)

"""Fused normalization kernels (Triton) with plain PyTorch references: `scalevec_kernels`.

A standalone library: it needs torch (and triton for the kernels), never the training framework.

Public API (N(x) = x / sqrt(mean(x^2) + eps) over the last dim, computed in fp32, written in
x.dtype; scales may have another dtype than x, e.g. fp32 scales with bf16 activations, and every
gradient comes back in its input's dtype):

    rms_norm_scales(x, scales, eps, residual=None, backend="auto") -> tuple[Tensor, ...]
        x: [..., N]; scales: list of K >= 1 tensors of shape [N], an entry None meaning an unscaled
        output N(x) (scales=None is [None]). With residual (shaped and typed like x) the input is
        h = x + residual and h is returned last: (y_1, ..., y_K, h); else (y_1, ..., y_K).
        Differentiable w.r.t. x, residual and every scale.

    head_rms_norm(x, scale, eps, backend="auto") -> Tensor
        x: [..., H, D], normalized per head; scale: [D] (shared across heads), [H, D] or [H * D]
        (full width), or None.

    swiglu_norm(gate, up, gate_scale, up_scale, eps, expert_offsets=None, backend="auto") -> Tensor
        silu(u_g * N(gate)) * (u_u * N(up)); gate, up: [..., F] of one shape and dtype. Each scale
        is None, [F] (shared by every row) or, with expert_offsets, [E, F]: the rows are grouped by
        expert and row r uses the scale row of the expert e with offsets[e-1] <= r < offsets[e]
        (expert_offsets: int [E], the cumulative row counts, the last one equal to the number of
        rows; experts may be empty). Differentiable w.r.t. gate, up and both scales.

    rms_norm_scales_reference, head_rms_norm_reference, swiglu_norm_reference
        The plain PyTorch computations (no backend argument).

    check_backend(backend, device_type) -> None
        Raises KernelError when `backend` is unknown or cannot run on tensors of that device type,
        so that a caller can validate its configuration before any work.

backend: "auto" runs the Triton kernels when x is on CUDA and triton imports (and the call fits
them: rms_norm_scales K <= 4, rows of up to 16384 features, tensors in fp32/bf16/fp16), else the
PyTorch reference; inside torch.compile it runs the reference (which torch.compile turns into its
own code) for the ops and shapes where the latest measurements on a GPU found that faster
(choice.py, measured/); "triton" insists on the kernels (on CPU only under TRITON_INTERPRET=1, set
before this package is imported) and raises KernelError where they cannot run; "torch" is the plain
reference. Every error of the package is a KernelError (a ValueError): bad backend names, misshapen
scales, residuals or offsets. Scale reparameterizations (`or`: s = beta * alpha / rms(alpha), `er`)
are computed by the caller with ordinary torch ops, once per step; autograd carries the kernels' ds
on to beta and alpha.

Compiling the kernels ahead of time and modelling their memory traffic from the SASS are maintainer
tools outside this package (dev/kernel_tools/; tests/kernels/test_compile_ahead.py): a run needs
none of them. The kernel modules declare what those tools read: ROW_ARGS, each kernel's [rows, N]
arguments.

The Triton paths go through the ops `torch.ops.scalevec.rms_norm_fwd` / `rms_norm_bwd` and
`swiglu_norm_fwd` / `swiglu_norm_bwd` (registered with torch.library, with fake implementations and
autograd), so torch.compile keeps one graph.
"""

from .backend import BACKENDS, check_backend
from .errors import KernelError
from .head_rms_norm import head_rms_norm, head_rms_norm_reference
from .rms_norm import rms_norm_scales, rms_norm_scales_reference
from .swiglu_norm import swiglu_norm, swiglu_norm_reference

__all__ = ["BACKENDS", "KernelError", "check_backend", "head_rms_norm", "head_rms_norm_reference",
           "rms_norm_scales", "rms_norm_scales_reference", "swiglu_norm", "swiglu_norm_reference"]

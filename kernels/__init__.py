"""Fused RMSNorm + scale kernels (Triton), installed as `scalevec_kernels`.

Public API (N(x) = x / sqrt(mean(x^2) + eps) over the last dim, computed in fp32, written in x.dtype;
scales may have another dtype than x, e.g. fp32 scales with bf16 activations, and their gradients
come back in the scale's dtype):

    rms_norm_scales(x, scales, eps, residual=None, backend="auto") -> tuple[Tensor, ...]
        x: [..., N]; scales: list of K >= 1 tensors of shape [N], an entry None meaning an unscaled
        output N(x) (scales=None is [None]). With residual (shaped and typed like x) the input is
        h = x + residual and h is returned last: (y_1, ..., y_K, h); else (y_1, ..., y_K).
        Differentiable w.r.t. x, residual and every scale.

    head_rms_norm(x, scale, eps, backend="auto") -> Tensor
        x: [..., H, D], normalized per head; scale: [D] (shared across heads), [H, D] or [H * D]
        (full width), or None.

backend: "auto" runs the Triton kernels when x is on CUDA and triton imports (and the call fits them:
K <= 4, N <= 16384, x in fp32/bf16/fp16), else the PyTorch reference; "triton" insists on the kernels
(on CPU only under TRITON_INTERPRET=1, set before this package is imported) and raises
ScalevecError where they cannot run; "torch" is the plain reference. Bad backend names raise
ScalevecError; misshapen scales or residual raise ValueError. Scale reparameterizations
(`or`: s = beta * alpha / rms(alpha), `er`) are computed by the caller with ordinary torch ops, once
per step; autograd carries the kernels' ds on to beta and alpha.

The Triton path goes through the ops `torch.ops.scalevec.rms_norm_fwd` / `rms_norm_bwd` (registered
with torch.library, with fake implementations and autograd), so torch.compile keeps one graph.
"""

from .head_rms_norm import head_rms_norm, head_rms_norm_reference
from .rms_norm import BACKENDS, rms_norm_scales, rms_norm_scales_reference

__all__ = ["BACKENDS", "head_rms_norm", "head_rms_norm_reference", "rms_norm_scales",
           "rms_norm_scales_reference"]

"""Per-head RMSNorm with a learnable scale: the QK-norm of the spec's `dual_norm` placement.

Each head's D features are normalized on their own. The scale is shared across heads ([D]) or full
width ([H, D] or [H * D]). It runs on the row kernels of rms_norm.py with rows of D features: a
shared scale is the plain K = 1 case, a full-width one sets groups = H so that row r (head r % H of
the contiguous [..., H, D] input) reads scale row r % H, and the backward's persistent programs each
accumulate the gradient of one head's scale row.
"""

import torch
from torch import Tensor

from .backend import use_triton
from .errors import KernelError
from .rms_norm import fused_forward, misfit


def head_rms_norm_reference(x: Tensor, scale: Tensor | None, eps: float) -> Tensor:
    """Plain PyTorch: N over the last dim of x [..., H, D], times scale broadcast over heads."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if scale is not None:
        normed = normed * scale.float().reshape(-1, x.shape[-1])
    return normed.to(x.dtype)


def head_rms_norm(x: Tensor, scale: Tensor | None, eps: float, backend: str = "auto") -> Tensor:
    """s * N_h(x) for x [..., H, D] and s of shape [D], [H, D], [H * D] or None (s = 1)."""
    if x.dim() < 2:
        raise KernelError(f"head_rms_norm: x must be [..., H, D], got shape {tuple(x.shape)}.",
                          "Split the last dim into heads first, e.g. x.unflatten(-1, (H, D)).")
    heads, d = x.shape[-2:]
    groups = 1
    if scale is not None:
        if scale.shape in ((heads, d), (heads * d,)):
            groups = heads
        elif scale.shape != (d,):
            raise KernelError(f"head_rms_norm: scale has shape {tuple(scale.shape)}; "
                              f"expected ({d},), ({heads}, {d}) or ({heads * d},) for x of shape "
                              f"{tuple(x.shape)}.",
                              "Pass a scale shared across heads, one row per head, or None.")
    if not use_triton(backend, x, misfit(x, 1), shape=("rms_norm", d, 1)):
        return head_rms_norm_reference(x, scale, eps)
    # The kernels index a full-width scale as [H, D] contiguous rows, whatever its shape
    (y,), _ = fused_forward(x, None, [scale], groups, eps)
    return y

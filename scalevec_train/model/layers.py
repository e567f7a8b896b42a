"""The building blocks of a block: the residual stream, the pre-norm with its branch sites, the
linear map with the sites and output normalization its plan gives it (map_output applies that output
side, for Linear and for the experts' SwiGLU alike), and rotary position embeddings."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import head_rms_norm, rms_norm_scales
from scalevec_train.model.config import ModelConfig
from scalevec_train.model.plan import Branch, MapPlan, NormKind, PreNormPlan
from scalevec_train.model.strategies import ScaleSite


def scaled(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x * s in x's dtype: s stays fp32 (docs/concepts/scale-vectors.md, precision), only the
    product takes the activations' dtype."""
    return x if s is None else (x * s).to(x.dtype)


def normalized(y: torch.Tensor, s: torch.Tensor | None, eps: float, kernels: str,
               expert_of: torch.Tensor | None = None) -> torch.Tensor:
    """u * N(y) over y's last dim; a per-expert u [experts, width] gives row r the row of its expert
    expert_of[r]."""
    if s is None or s.dim() == 1:
        return rms_norm_scales(y, [s], eps, backend=kernels)[0]
    normed = rms_norm_scales(y, [None], eps, backend=kernels)[0]
    return (normed * s.index_select(0, expert_of)).to(y.dtype)


def map_output(y: torch.Tensor, site: ScaleSite | None, eps: float, kernels: str,
               expert_of: torch.Tensor | None = None, folded: bool = False) -> torch.Tensor:
    """A map's output y [..., width] after its site: u * N(y) when the site sits behind a
    normalization over the width, else y * u (or y itself when `folded`: u is already in the map's
    weight)."""
    if site is None:
        return y
    if not site.behind_norm:
        return y if folded else scaled(y, site())
    return normalized(y, site(), eps, kernels, expert_of)


class Residual(NamedTuple):
    """The residual stream as x + plus, the update not added yet: the next pre-norm adds it in the
    same fused pass that normalizes the sum (and hands the sum on), so that no block writes x + plus
    alone."""

    x: torch.Tensor
    plus: torch.Tensor | None = None


class PreNorm(nn.Module):
    """N(x), computed once, then one scaled copy per branch site of its plan."""

    def __init__(self, plan: PreNormPlan, cfg: ModelConfig):
        super().__init__()
        self.eps, self.kernels = cfg.norm_eps, cfg.kernels
        self.branches = tuple(plan.sites)
        self.sites = nn.ModuleDict({str(b): ScaleSite.of(row) for b, row in plan.sites.items()})

    def forward(self, stream: Residual) -> tuple[dict[Branch, torch.Tensor], torch.Tensor]:
        """({branch: s_branch * N(h)}, h) with h = stream.x + stream.plus, summed in the norm's
        pass."""
        scales = [s() for s in self.sites.values()]
        outs = rms_norm_scales(stream.x, scales, self.eps, residual=stream.plus,
                               backend=self.kernels)
        h = stream.x
        if stream.plus is not None:
            *outs, h = outs
        return dict(zip(self.branches, outs, strict=True)), h


class Linear(nn.Module):
    """y = s_out * Norm(W (s_in * x)): a bias-free linear map with the sites its plan gives it."""

    # W x: F.linear, or on a map that model.fp8 converts the FP8 matmul that parallel/fp8.py sets on
    # the instance (from outside: the model never imports torchao)
    matmul = staticmethod(F.linear)

    def __init__(self, plan: MapPlan, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(plan.d_out, plan.d_in))
        self.map_name = plan.ref.name  # q, k, ..., down: what scale.targets and model.fp8_keep name
        self.in_site = None if plan.in_site is None else ScaleSite.of(plan.in_site)
        self.out_site = None if plan.out_site is None else ScaleSite.of(plan.out_site)
        self.out_norm = plan.out_norm
        self.eps, self.head_dim, self.kernels = cfg.norm_eps, cfg.head_dim, cfg.kernels

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """W (s_in * x): the map before its output normalization and site."""
        if self.in_site is not None:
            x = scaled(x, self.in_site())
        return self.matmul(x, self.weight)

    def output_scale(self) -> torch.Tensor | None:
        """The output site's vector (None without one, or fixed): what a fused SwiGLU applies."""
        return None if self.out_site is None else self.out_site()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        if self.out_norm is NormKind.HEAD:
            s = self.output_scale()
            heads = y.unflatten(-1, (-1, self.head_dim))
            s = s.view(-1, self.head_dim) if s is not None and s.numel() != self.head_dim else s
            return head_rms_norm(heads, s, self.eps, backend=self.kernels).flatten(-2)
        return map_output(y, self.out_site, self.eps, self.kernels)


class Rotary(nn.Module):
    """RoPE in the rotate-half convention (the layout Hugging Face Llama checkpoints use)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)

    def init_buffers(self) -> None:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64)
                                        / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim]; positions [batch, seq] (default: 0..seq-1 in every
        row)."""
        if positions is None:
            seq = x.shape[-2]
            cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        else:
            cos, sin = (self.cos[positions].to(x.dtype).unsqueeze(1),
                        self.sin[positions].to(x.dtype).unsqueeze(1))
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

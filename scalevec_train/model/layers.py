"""The building blocks of a block: the pre-norm with its branch sites, the linear map with the sites
and output normalization the strategy gives it, and rotary position embeddings."""

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import head_rms_norm, rms_norm_scales
from scalevec_train.model.config import ModelConfig
from scalevec_train.model.strategies import MapInput, ScaleConfig, ScaleSite, SiteMaps, plan_map


def scaled(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x * s in x's dtype: s stays fp32 (spec, precision), only the product takes the activations' dtype."""
    return x if s is None else (x * s).to(x.dtype)


class PreNorm(nn.Module):
    """N(x), computed once, then one scaled copy per branch site. Given the residual stream's pending
    update (`delta`), the norm adds it first in the same pass and returns the new stream too: the block
    never writes x + delta on its own."""

    def __init__(self, cfg: ModelConfig, branches: list[str], scale: ScaleConfig):
        super().__init__()
        self.eps, self.kernels = cfg.norm_eps, cfg.kernels
        dim = cfg.dim
        param = scale.site_param("input")
        # The "norm" branch hands N(x) itself to MoE experts that carry their own per-expert sites.
        self.sites = nn.ModuleDict({b: ScaleSite((dim,), "input", "fixed" if b == "norm" else param)
                                    for b in branches})

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """({branch: s_branch * N(h)}, h) with h = x + delta (x itself without a delta)."""
        if delta is not None:
            # Under autocast the update may be bf16 while the stream is fp32: x + delta promotes, so do we.
            delta = delta.to(x.dtype)
        scales = [s() for s in self.sites.values()]
        outs = rms_norm_scales(x, scales, self.eps, residual=delta, backend=self.kernels)
        if delta is not None:
            *outs, x = outs
        return dict(zip(self.sites.keys(), outs, strict=True)), x


class Linear(nn.Module):
    """y = s_out * Norm(W (s_in * x)): a bias-free linear map with the sites the strategy gives it."""

    def __init__(self, name: str, d_in: int, d_out: int, scale: ScaleConfig, model: ModelConfig):
        super().__init__()
        plan = plan_map(scale, name, model.qk_norm, model.post_norm)
        self.name = name
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.in_site = ScaleSite((d_in,), "input", scale.site_param("input")) if plan.in_site else None
        self.out_norm, self.eps, self.head_dim = plan.out_norm, model.norm_eps, model.head_dim
        self.kernels = model.kernels
        self.out_site = None
        if plan.out_site:
            full = self.out_norm != "head" or scale.head_site_shape == "full"
            shape = (d_out,) if full else (model.head_dim,)
            self.out_site = ScaleSite(shape, "output", scale.site_param("output"),
                                      behind_norm=plan.out_norm is not None)

    def as_input(self) -> MapInput:
        norm = None if self.out_norm is None else f"N_h({self.name})" if self.out_norm == "head" else f"N({self.name})"
        return MapInput(self.weight, norm)

    def site_maps(self) -> list[SiteMaps]:
        sides = (("in", self.in_site), ("out", self.out_site))
        return [SiteMaps(site, side, (self.as_input(),)) for side, site in sides if site is not None]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """W (s_in * x): the map before its output normalization and site."""
        if self.in_site is not None:
            x = scaled(x, self.in_site())
        return F.linear(x, self.weight)

    def out_scale(self) -> torch.Tensor | None:
        return self.out_site() if self.out_site is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        s = self.out_scale()
        if self.out_norm == "head":
            heads = y.unflatten(-1, (-1, self.head_dim))
            s = s.view(-1, self.head_dim) if s is not None and s.numel() != self.head_dim else s
            return head_rms_norm(heads, s, self.eps, backend=self.kernels).flatten(-2)
        if self.out_norm == "full":
            return rms_norm_scales(y, [s], self.eps, backend=self.kernels)[0]
        return scaled(y, s)


class Rotary(nn.Module):
    """RoPE in the rotate-half convention (the layout Hugging Face Llama checkpoints use)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)

    def init_buffers(self) -> None:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim]; positions [batch, seq] (default: 0..seq-1 in every row)."""
        if positions is None:
            seq = x.shape[-2]
            cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        else:
            cos, sin = self.cos[positions].to(x.dtype).unsqueeze(1), self.sin[positions].to(x.dtype).unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

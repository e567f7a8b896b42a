"""The building blocks of a block: the pre-norm with its branch sites, the linear map with the sites
and output normalization the strategy gives it (map_sites builds them, map_output applies them, for
Linear and for the experts' SwiGLU alike), and rotary position embeddings."""

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import head_rms_norm, rms_norm_scales
from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.model.strategies import NORM_FLOPS, ScaledMap, ScaleSite, SiteMaps, plan_map


def scaled(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x * s in x's dtype: s stays fp32 (docs/scale-vectors.md, precision), only the product takes the
    activations' dtype."""
    return x if s is None else (x * s).to(x.dtype)


def map_sites(scale: ScaleConfig, model: ModelConfig, name: str, d_in: int, d_out: int, rows: tuple[int, ...] = ()
              ) -> tuple[ScaleSite | None, ScaleSite | None, str | None]:
    """(input site, output site, output normalization) of linear map `name` [d_out, d_in] as plan_map
    places them; `rows`: leading dims of the sites (one row per routed expert). An output site on a
    per-head normalization has head_dim entries unless scale.head_site_shape is full."""
    plan = plan_map(scale, name, model.qk_norm, model.post_norm)
    in_site = ScaleSite(rows + (d_in,), "input", scale.site_param("input")) if plan.in_site else None
    out_site = None
    if plan.out_site:
        full = plan.out_norm != "head" or scale.head_site_shape == "full"
        out_site = ScaleSite(rows + ((d_out,) if full else (model.head_dim,)), "output", scale.site_param("output"),
                             behind_norm=plan.out_norm is not None)
    return in_site, out_site, plan.out_norm


def map_output(y: torch.Tensor, site: ScaleSite | None, eps: float, kernels: str,
               expert_of: torch.Tensor | None = None, folded: bool = False) -> torch.Tensor:
    """A map's output y [..., width] after its site: u * N(y) when the site sits behind a normalization
    over the width (a per-expert u gives row r the row of its expert expert_of[r]), else y * u (or y
    itself when `folded`: u is already in the map's weight)."""
    if site is None:
        return y
    if not site.behind_norm:
        return y if folded else scaled(y, site())
    s = site()
    if s is None or s.dim() == 1:
        return rms_norm_scales(y, [s], eps, backend=kernels)[0]
    normed = rms_norm_scales(y, [None], eps, backend=kernels)[0]
    return (normed * s.index_select(0, expert_of)).to(y.dtype)


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
        scales = [s() for s in self.sites.values()]
        outs = rms_norm_scales(x, scales, self.eps, residual=delta, backend=self.kernels)
        if delta is not None:
            *outs, x = outs
        return dict(zip(self.sites.keys(), outs, strict=True)), x

    def norm_flops_per_token(self) -> int:
        """Forward FLOPs per token of the normalization and its sites."""
        width = next(iter(self.sites.values())).shape[-1]
        return NORM_FLOPS * width + sum(s.flops_per_token() for s in self.sites.values())


class Linear(nn.Module):
    """y = s_out * Norm(W (s_in * x)): a bias-free linear map with the sites the strategy gives it."""

    def __init__(self, name: str, d_in: int, d_out: int, scale: ScaleConfig, model: ModelConfig):
        super().__init__()
        self.name = name
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.in_site, self.out_site, self.out_norm = map_sites(scale, model, name, d_in, d_out)
        self.eps, self.head_dim, self.kernels = model.norm_eps, model.head_dim, model.kernels

    def as_input(self) -> ScaledMap:
        norm = None if self.out_norm is None else f"N_h({self.name})" if self.out_norm == "head" else f"N({self.name})"
        return ScaledMap(self.weight, norm)

    def site_maps(self) -> list[SiteMaps]:
        sides = (("in", self.in_site), ("out", self.out_site))
        return [SiteMaps(site, side, (self.as_input(),)) for side, site in sides if site is not None]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """W (s_in * x): the map before its output normalization and site."""
        if self.in_site is not None:
            x = scaled(x, self.in_site())
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(x)
        if self.out_norm == "head":
            s = self.out_site()
            heads = y.unflatten(-1, (-1, self.head_dim))
            s = s.view(-1, self.head_dim) if s is not None and s.numel() != self.head_dim else s
            return head_rms_norm(heads, s, self.eps, backend=self.kernels).flatten(-2)
        return map_output(y, self.out_site, self.eps, self.kernels)

    def norm_flops_per_token(self) -> int:
        """Forward FLOPs per token of the map's sites and its output normalization."""
        d_out, d_in = self.weight.shape
        sites = sum(s.flops_per_token(width) for s, width in ((self.in_site, d_in), (self.out_site, d_out))
                    if s is not None)
        return sites + (NORM_FLOPS * d_out if self.out_norm is not None else 0)


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

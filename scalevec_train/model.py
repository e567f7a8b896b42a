"""The decoder: Llama-style pre-norm blocks (RMSNorm, RoPE, grouped-query attention, SwiGLU or MoE),
with scale sites placed by the strategy (strategies.py). A plain nn.Module: parallelism, precision and
compilation are applied from outside.

    a = N(x) scaled per branch             (attn_norm: one site, or q/k/v sites under HG)
    q, k, v = Wq a_q, Wk a_k, Wv a_v       (each map may have an output norm and site: QK-norm, DNP)
    h = x + Wo SDPA(rope(q), rope(k), v)   (Wo may have input/output sites and a post-norm)
    b = N(h) scaled per branch             (ffn_norm)
    y = h + Wdown (silu(Wgate b_g) * Wup b_u)
    logits = Whead (s_final * N(x_L))

Initialization (documented in configs/model/*.yaml): embeddings and every matrix ~ N(0, init_std),
the maps that write into the residual stream (o, down) ~ N(0, init_std / sqrt(2 * n_layers)); every
scale site starts at s = 1. Values depend only on (seed, parameter name), never on sharding.
"""

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import head_rms_norm, rms_norm_scales
from scalevec_train.errors import ScalevecError
from scalevec_train.moe import MoEConfig, MoEFeedForward
from scalevec_train.strategies import MapInput, ScaleConfig, ScaleSite, SiteMaps, input_branches, plan_map


@dataclass
class ModelConfig:
    # preset name, used in run names
    name: str = "dense-tiny"
    # residual stream width
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # key/value heads for grouped-query attention; must divide n_heads
    n_kv_heads: int = 4
    # SwiGLU hidden width (dense layers and the shared expert's default)
    ffn_dim: int = 688
    # must be >= the tokenizer's vocab size
    vocab_size: int = 4096
    # longest sequence RoPE tables are built for
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # per-head RMSNorm of q and k with an output scale site (the spec's g_q, g_k)
    qk_norm: bool = False
    # Gemma/OLMo-2 style normalization of each sub-layer's output (the spec's g_o, g_down)
    post_norm: bool = False
    # share the token embedding with the output head
    tie_embeddings: bool = True
    # std of the normal init of embeddings and matrices (see the module docstring)
    init_std: float = 0.02
    # null for a dense model; see moe.py for the options
    moe: MoEConfig | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"model.{key}", f"must be positive, got {getattr(self, key)}.")
        if self.dim % self.n_heads:
            raise ScalevecError("model.dim", f"hidden size {self.dim} is not divisible by "
                                f"model.n_heads={self.n_heads}.", "pick n_heads dividing dim.")
        if self.head_dim % 2:
            raise ScalevecError("model.n_heads", f"head_dim={self.head_dim} is odd; RoPE needs it even.",
                                "change dim or n_heads.")
        if self.n_heads % self.n_kv_heads:
            raise ScalevecError("model.n_kv_heads", f"{self.n_kv_heads} does not divide "
                                f"n_heads={self.n_heads}.", "use a divisor of n_heads.")
        if self.moe is not None:
            self.moe.validate(self.dim)


def scaled(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x * s in x's dtype: s stays fp32 (spec, precision), only the product takes the activations' dtype."""
    return x if s is None else (x * s).to(x.dtype)


class PreNorm(nn.Module):
    """N(x), computed once, then one scaled copy per branch site."""

    def __init__(self, dim: int, branches: list[str], scale: ScaleConfig, eps: float):
        super().__init__()
        self.eps = eps
        self.kernels = "auto"
        param = scale.site_param("input")
        # The "norm" branch hands N(x) itself to MoE experts that carry their own per-expert sites.
        self.sites = nn.ModuleDict({b: ScaleSite((dim,), "input", "fixed" if b == "norm" else param)
                                    for b in branches})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        outs = rms_norm_scales(x, [s() for s in self.sites.values()], self.eps, backend=self.kernels)
        return dict(zip(self.sites.keys(), outs, strict=True))


class Linear(nn.Module):
    """y = s_out * Norm(W (s_in * x)): a bias-free linear map with the sites the strategy gives it."""

    def __init__(self, name: str, d_in: int, d_out: int, scale: ScaleConfig, model: ModelConfig):
        super().__init__()
        plan = plan_map(scale, name, model.qk_norm, model.post_norm)
        self.name = name
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.in_site = ScaleSite((d_in,), "input", scale.site_param("input")) if plan.in_site else None
        self.out_norm, self.eps, self.head_dim = plan.out_norm, model.norm_eps, model.head_dim
        self.kernels = "auto"
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_site is not None:
            x = scaled(x, self.in_site())
        y = F.linear(x, self.weight)
        s = self.out_site() if self.out_site is not None else None
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, heads, seq, head_dim]."""
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wq = Linear("q", cfg.dim, q_width, scale, cfg)
        self.wk = Linear("k", cfg.dim, kv_width, scale, cfg)
        self.wv = Linear("v", cfg.dim, kv_width, scale, cfg)
        self.wo = Linear("o", q_width, cfg.dim, scale, cfg)

    def input_maps(self, branch: str) -> list[MapInput]:
        """The maps that read pre-norm branch `branch`."""
        maps = {"q": [self.wq], "k": [self.wk], "v": [self.wv]}.get(branch, [self.wq, self.wk, self.wv])
        return [m.as_input() for m in maps]

    def site_maps(self) -> list[SiteMaps]:
        return [entry for m in (self.wq, self.wk, self.wv, self.wo) for entry in m.site_maps()]

    def forward(self, a: dict[str, torch.Tensor], rope: Rotary) -> torch.Tensor:
        shared = a.get("attn")
        q = self.wq(a.get("q", shared))
        k = self.wk(a.get("k", shared))
        v = self.wv(a.get("v", shared))
        batch, seq, _ = q.shape
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                             enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU."""

    def __init__(self, cfg: ModelConfig, scale: ScaleConfig, hidden: int):
        super().__init__()
        self.w_gate = Linear("gate", cfg.dim, hidden, scale, cfg)
        self.w_up = Linear("up", cfg.dim, hidden, scale, cfg)
        self.w_down = Linear("down", hidden, cfg.dim, scale, cfg)

    def input_maps(self, branch: str) -> list[MapInput]:
        maps = {"gate": [self.w_gate], "up": [self.w_up]}.get(branch, [self.w_gate, self.w_up])
        return [m.as_input() for m in maps]

    def site_maps(self) -> list[SiteMaps]:
        return [entry for m in (self.w_gate, self.w_up, self.w_down) for entry in m.site_maps()]

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        shared = b.get("ffn")
        return self.w_down(F.silu(self.w_gate(b.get("gate", shared))) * self.w_up(b.get("up", shared)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        moe = cfg.moe is not None
        self.attn_norm = PreNorm(cfg.dim, input_branches(scale, "attn"), scale, cfg.norm_eps)
        self.attn = Attention(cfg, scale)
        self.ffn_norm = PreNorm(cfg.dim, input_branches(scale, "ffn", moe), scale, cfg.norm_eps)
        self.ffn = MoEFeedForward(cfg, scale) if moe else FeedForward(cfg, scale, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: Rotary) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), rope)
        return h + self.ffn(self.ffn_norm(h))

    def site_maps(self) -> list[SiteMaps]:
        """Every site of the block with the maps it scales (folding, describe)."""
        found = [SiteMaps(site, "in", tuple(sub.input_maps(branch)))
                 for norm, sub in ((self.attn_norm, self.attn), (self.ffn_norm, self.ffn))
                 for branch, site in norm.sites.items()]
        return found + self.attn.site_maps() + self.ffn.site_maps()


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: ScaleConfig):
        super().__init__()
        self.cfg, self.scale = cfg, scale
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg, scale) for _ in range(cfg.n_layers))
        self.final_norm = PreNorm(cfg.dim, ["final"], scale, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[-1]} tokens exceeds model.max_seq_len="
                             f"{self.cfg.max_seq_len}")
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        x = self.final_norm(x)["final"]
        weight = self.tok_emb.weight if self.head is None else self.head.weight
        return F.linear(x, weight)

    def site_maps(self) -> list[SiteMaps]:
        """Every scale site with the maps it scales: what folding absorbs and what describe reports."""
        head = self.tok_emb.weight if self.head is None else self.head.weight
        found = [SiteMaps(self.final_norm.sites["final"], "in", (MapInput(head, None),))]
        for block in self.layers:
            found += block.site_maps()
        return found

    def set_kernels(self, backend: str) -> None:
        """Select the normalization backend (auto | triton | torch) for every norm in the model."""
        for m in self.modules():
            if hasattr(m, "kernels"):
                m.kernels = backend

    def initial_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The initial value of parameter `name`: a function of (seed, name) only."""
        owner = self.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self
        if isinstance(owner, ScaleSite):
            return torch.zeros(shape) if name.endswith(".b") else torch.ones(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        std = self.cfg.init_std
        if name.endswith(("wo.weight", "w_down.weight")) or ".experts.w_down" in name:
            std /= math.sqrt(2 * self.cfg.n_layers)
        return torch.randn(shape, generator=gen) * std

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialize every parameter and buffer in place (single device; see distributed.py for
        sharded models, which use initial_value too)."""
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape, seed))
        self.init_buffers()

    def init_buffers(self) -> None:
        for m in self.modules():
            if m is not self and hasattr(m, "init_buffers"):
                m.init_buffers()

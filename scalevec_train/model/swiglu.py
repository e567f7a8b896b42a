"""SwiGLU with scale sites, the one piece the dense feed-forward (transformer.py), the shared expert and
the routed experts (moe.py) build their inner sites and pick the fused path through:

    hidden = silu(o_gate(W_gate (s_gate_in * x_g))) * o_up(W_up (s_up_in * x_u))
    y      = W_down (s_down_in * hidden)

o_m is map m's output side as the strategy's plan says: u_m * N(.) behind a normalization of the hidden
width, u_m * (.) without one, nothing without a site. When gate and up are both normalized, one fused
pass (scalevec_kernels.swiglu_norm) does both normalizations and the product.

The dense feed-forward holds its sites in its `Linear` maps; an expert (stack) holds them itself as
gate_in, up_in (its own input sites under per_expert), gate_out, up_out and down_in (`ExpertSwiGLU`),
one row per routed expert, and applies the sites that sit behind no normalization to its weights
(W * s: the same function, cheaper than scaling tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import swiglu_norm
from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.model.layers import map_output, map_sites
from scalevec_train.model.strategies import NORM_FLOPS, ScaledMap, ScaleSite, SiteMaps


def swiglu(gate: torch.Tensor, up: torch.Tensor, gate_site: ScaleSite | None, up_site: ScaleSite | None,
           eps: float, kernels: str, counts: torch.Tensor | None = None, expert_of: torch.Tensor | None = None,
           folded: bool = False) -> torch.Tensor:
    """silu(o_gate(gate)) * o_up(up) from the maps' outputs before their normalizations and sites.
    Rows grouped by expert give `counts` (rows per expert) and `expert_of` (each row's expert) for
    per-expert sites; `folded`: sites behind no normalization are already in the weights."""
    if gate_site is not None and up_site is not None and gate_site.behind_norm and up_site.behind_norm:
        offsets = None if counts is None else counts.cumsum(0)
        return swiglu_norm(gate, up, gate_site(), up_site(), eps, expert_offsets=offsets, backend=kernels)
    return (F.silu(map_output(gate, gate_site, eps, kernels, expert_of, folded))
            * map_output(up, up_site, eps, kernels, expert_of, folded))


def fold_sites(w: torch.Tensor, s_in: ScaleSite | None, s_out: ScaleSite | None) -> torch.Tensor:
    """W with an input site on its columns and an output site behind no normalization on its rows
    (W [..., out, in])."""
    s = s_in() if s_in is not None else None
    if s is not None:
        w = w * s.unsqueeze(-2)
    s = s_out() if s_out is not None and not s_out.behind_norm else None
    if s is not None:
        w = w * s.unsqueeze(-1)
    return w


class ExpertSwiGLU(nn.Module):
    """The sites inside an expert's SwiGLU (or a stack of `experts` of them) whose weights the subclass
    holds: `weights()` gives (W_gate, W_up, W_down) as [..., out, in]. A subclass registers its weights
    first, then calls add_sites (the order of the parameters, which checkpoints and optimizer state
    follow)."""

    gate_in: ScaleSite | None
    up_in: ScaleSite | None
    gate_out: ScaleSite | None
    up_out: ScaleSite | None
    down_in: ScaleSite | None

    def add_sites(self, cfg: ModelConfig, scale: ScaleConfig, hidden: int, experts: int | None) -> None:
        """Its own gate/up input sites under per_expert, gate/up output sites under dual placement
        (behind a normalization of the hidden width under dual_norm), the input site of a targeted down
        map. Sites on the hidden units have one row per expert: unit j of one expert has nothing to do
        with unit j of another. Missing sites are None."""
        rows = (experts,) if experts else ()
        self.gate_in = self.up_in = None
        self.eps, self.kernels = cfg.norm_eps, cfg.kernels
        if scale.per_expert:
            self.gate_in = ScaleSite(rows + (cfg.dim,), "input", scale.site_param("input"))
            self.up_in = ScaleSite(rows + (cfg.dim,), "input", scale.site_param("input"))
        self.gate_out = map_sites(scale, cfg, "gate", cfg.dim, hidden, rows)[1]
        self.up_out = map_sites(scale, cfg, "up", cfg.dim, hidden, rows)[1]
        self.down_in = map_sites(scale, cfg, "down", hidden, cfg.dim, rows)[0]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def folded_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W_gate, W_up, W_down) with the sites behind no normalization applied."""
        w_gate, w_up, w_down = self.weights()
        return (fold_sites(w_gate, self.gate_in, self.gate_out), fold_sites(w_up, self.up_in, self.up_out),
                fold_sites(w_down, self.down_in, None))

    def hidden(self, gate: torch.Tensor, up: torch.Tensor, counts: torch.Tensor | None = None,
               expert_of: torch.Tensor | None = None) -> torch.Tensor:
        """swiglu() of the folded maps' outputs (rows grouped by expert: counts, expert_of)."""
        return swiglu(gate, up, self.gate_out, self.up_out, self.eps, self.kernels, counts, expert_of, folded=True)

    def input_maps(self) -> tuple[ScaledMap, ScaledMap]:
        """The gate and up maps as the sites before them see them."""
        w_gate, w_up, _ = self.weights()
        return ScaledMap(w_gate, _norm_label(self.gate_out, "gate")), ScaledMap(w_up, _norm_label(self.up_out, "up"))

    def site_maps(self) -> list[SiteMaps]:
        gate, up = self.input_maps()
        down = ScaledMap(self.weights()[2], None)
        pairs = [(self.gate_in, "in", gate), (self.up_in, "in", up), (self.gate_out, "out", gate),
                 (self.up_out, "out", up), (self.down_in, "in", down)]
        return [SiteMaps(site, side, (m,)) for site, side, m in pairs if site is not None]

    def norm_flops_per_token(self) -> int:
        """Forward FLOPs per token through one expert: its sites and the normalizations behind gate and up."""
        sites = (self.gate_in, self.up_in, self.gate_out, self.up_out, self.down_in)
        total = sum(s.flops_per_token() for s in sites if s is not None)
        return total + sum(NORM_FLOPS * s.shape[-1] for s in (self.gate_out, self.up_out)
                           if s is not None and s.behind_norm)


def _norm_label(site: ScaleSite | None, name: str) -> str | None:
    """The normalization right after map `name` (gate or up) of an expert (stack), if any."""
    return f"N({name})" if site is not None and site.behind_norm else None

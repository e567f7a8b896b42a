"""SwiGLU with scale sites, the one piece the dense feed-forward (transformer.py), the shared expert
and the routed experts (moe.py) build their inner sites and pick the fused path through:

    hidden = silu(o_gate(W_gate (s_gate_in * x_g))) * o_up(W_up (s_up_in * x_u))
    y      = W_down (s_down_in * hidden)

o_m is map m's output side as its plan (plan.py's MapPlan) says: u_m * N(.) behind a normalization
of the hidden width, u_m * (.) without one, nothing without a site. When gate and up are both
normalized, one fused pass (scalevec_kernels.swiglu_norm) does both normalizations and the product.

The dense feed-forward holds its sites in its `Linear` maps; an expert (stack) holds them itself as
gate_in, up_in (its own input sites under per_expert), gate_out, up_out and down_in
(`ExpertSwiGLU`), one row per routed expert, and applies the sites that sit behind no normalization
to its weights (W * s: the same function, cheaper than scaling tokens).
"""

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import swiglu_norm
from scalevec_train.model.config import ModelConfig
from scalevec_train.model.layers import normalized, scaled
from scalevec_train.model.plan import MapPlan, SwiGLUPlan
from scalevec_train.model.strategies import ScaleSite


class SwiGLU:
    """silu(o_gate(gate)) * o_up(up) from the maps' outputs before their output sides, given the
    sites' vectors (None: no site, or fixed); which sides are normalized, and so whether the fused
    pass runs, is the plan's."""

    def __init__(self, gate: MapPlan, up: MapPlan, cfg: ModelConfig):
        self.gate_normed, self.up_normed = gate.out_norm is not None, up.out_norm is not None
        self.eps, self.kernels = cfg.norm_eps, cfg.kernels

    def __call__(self, gate: torch.Tensor, up: torch.Tensor, s_gate: torch.Tensor | None,
                 s_up: torch.Tensor | None, offsets: torch.Tensor | None = None,
                 expert_of: torch.Tensor | None = None, folded: bool = False) -> torch.Tensor:
        """Rows grouped by expert give `offsets` (each expert's end row) and `expert_of` (each row's
        expert) for per-expert sites; `folded`: the sites behind no normalization are already in the
        weights."""
        if self.gate_normed and self.up_normed:
            return swiglu_norm(gate, up, s_gate, s_up, self.eps, expert_offsets=offsets,
                               backend=self.kernels)
        return (F.silu(self._side(gate, s_gate, self.gate_normed, expert_of, folded))
                * self._side(up, s_up, self.up_normed, expert_of, folded))

    def _side(self, y: torch.Tensor, s: torch.Tensor | None, normed: bool,
              expert_of: torch.Tensor | None, folded: bool) -> torch.Tensor:
        if normed:
            return normalized(y, s, self.eps, self.kernels, expert_of)
        return y if folded else scaled(y, s)


def fold_sites(w: torch.Tensor, s_in: ScaleSite | None, s_out: ScaleSite | None,
               rows: slice | None = None) -> torch.Tensor:
    """W with an input site on its columns and an output site behind no normalization on its rows
    (W [..., out, in]; `rows`: the experts of a stack that W holds, None: all)."""
    s = _vector(s_in, rows)
    if s is not None:
        w = w * s.unsqueeze(-2)
    s = _vector(s_out, rows) if s_out is not None and not s_out.behind_norm else None
    if s is not None:
        w = w * s.unsqueeze(-1)
    return w


class ExpertSwiGLU(nn.Module):
    """The sites inside an expert's SwiGLU (or a stack of them) whose weights the subclass holds:
    `weights()` gives (W_gate, W_up, W_down) as [..., out, in]. A subclass registers its weights
    first, then calls add_sites (the order of the parameters, which checkpoints and optimizer state
    follow)."""

    gate_in: ScaleSite | None
    up_in: ScaleSite | None
    gate_out: ScaleSite | None
    up_out: ScaleSite | None
    down_in: ScaleSite | None

    def add_sites(self, plan: SwiGLUPlan, cfg: ModelConfig) -> None:
        """The sites its plan lists (missing ones are None): its own gate/up input sites under
        per_expert, gate/up output sites under dual placement (behind a normalization of the hidden
        width under dual_norm), the input site of a targeted down map."""
        rows = (plan.gate.in_site, plan.up.in_site, plan.gate.out_site, plan.up.out_site,
                plan.down.in_site)
        for name, row in zip(("gate_in", "up_in", "gate_out", "up_out", "down_in"), rows,
                             strict=True):
            setattr(self, name, None if row is None else ScaleSite.of(row))
        self.swiglu = SwiGLU(plan.gate, plan.up, cfg)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def folded_weights(self, stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                       rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
        """(W_gate, W_up, W_down) with the sites behind no normalization applied: of `weights()`, or
        of `stacks`, the experts `rows` of a stack (an expert-parallel rank's)."""
        w_gate, w_up, w_down = self.weights() if stacks is None else stacks
        return (fold_sites(w_gate, self.gate_in, self.gate_out, rows),
                fold_sites(w_up, self.up_in, self.up_out, rows),
                fold_sites(w_down, self.down_in, None, rows))

    def hidden(self, gate: torch.Tensor, up: torch.Tensor, offsets: torch.Tensor | None = None,
               expert_of: torch.Tensor | None = None, rows: slice | None = None) -> torch.Tensor:
        """The SwiGLU of the folded maps' outputs (rows grouped by expert: offsets, expert_of, each
        relative to the experts `rows` of the sites, None: all)."""
        return self.swiglu(gate, up, _vector(self.gate_out, rows), _vector(self.up_out, rows),
                           offsets, expert_of, folded=True)


def _vector(site: ScaleSite | None, rows: slice | None = None) -> torch.Tensor | None:
    """A site's vector, or its rows `rows` (experts); None without a site."""
    if site is None:
        return None
    return site() if rows is None else site()[rows]

"""The parameterization (`model.parameterization`): how each parameter's initialization, the
forward's multipliers and, through the optimizer (optim/groups.py), each parameter's LR follow the
model's width and depth. docs/concepts/parameterization.md gives every rule with its source.

    sp    one init std (model.init_std; the maps into the residual stream / sqrt(2 n_layers)) and
          one LR at every size: every multiplier 1
    mup   muP for width (Tensor Programs V, Yang et al. 2022, Table 3 in the multiplier form of its
          `mup` package) and CompleteP for depth (Dey et al. 2025, alpha = 1), relative to a base
          shape (model.base_dim, base_layers, base_head_dim), with m_N = dim / base_dim,
          m_L = n_layers / base_layers:

    kind       parameters                             init std                forward multiplier
    embedding  tok_emb (tied or not)                  init_std                1 (a tied one as the
                                                                                readout: 1 / m_N)
    readout    head, MoE routers (width in, a fixed   init_std                1 / m_N on their
                                                                                outputs
               number of outputs)
    hidden     q k v o gate up down, experts          init_std / sqrt(m_N)    attention logits
                                                                                sqrt(base_head_dim)
               (width in and out)                     (o, down: also          / head_dim; every
                                                                                block's
                                                      / sqrt(2 base_layers))  residual branch
                                                                                1 / m_L
    vector     scale sites                            their own (s = 1)       -

At the base shape every multiplier is 1 and mup is sp exactly. The LR, weight decay and Adam eps of
each kind depend on the optimizer as well: optim/groups.py's `rates`.
"""

import math
from dataclasses import dataclass
from enum import StrEnum

from scalevec_train.model.config import ModelConfig


class Kind(StrEnum):
    """What muP sees in a parameter: which of its dimensions grow with the width."""

    EMBEDDING = "embedding"  # a fixed number of inputs (tokens), the width out
    READOUT = "readout"  # the width in, a fixed number of outputs (the vocabulary, the experts)
    HIDDEN = "hidden"  # the width in and out
    VECTOR = "vector"  # one entry per feature: a scale site


# the maps whose outputs join the residual stream (sp's init divides them by sqrt(2 n_layers))
RESIDUAL_WRITERS = ("wo.weight", "w_down.weight", ".experts.w_down")


@dataclass(frozen=True)
class Parameterization:
    name: str
    width: float  # m_N
    depth: float  # m_L
    init_std: float
    layers_at_base: int  # the depth sp's residual-writer init is computed for
    head_dim: int
    base_head_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "Parameterization":
        if cfg.parameterization == "sp":
            return cls("sp", 1.0, 1.0, cfg.init_std, cfg.n_layers, cfg.head_dim, cfg.head_dim)
        base_dim = cfg.base_dim or cfg.dim
        base_layers = cfg.base_layers or cfg.n_layers
        return cls("mup", cfg.dim / base_dim, cfg.n_layers / base_layers, cfg.init_std, base_layers,
                   cfg.head_dim, cfg.base_head_dim or cfg.head_dim)

    @staticmethod
    def kind(name: str, site_parameters) -> Kind:
        """The kind of parameter `name`; `site_parameters`: the names of the scale sites' (the
        plan's)."""
        if name in site_parameters:
            return Kind.VECTOR
        if name == "tok_emb.weight":
            return Kind.EMBEDDING
        if name == "head.weight" or name.endswith("router.weight"):
            return Kind.READOUT
        return Kind.HIDDEN

    def init(self, name: str, kind: Kind) -> float:
        """The std of the normal init of a parameter that is not a scale site's."""
        std = self.init_std
        if kind is Kind.HIDDEN:
            std /= math.sqrt(self.width)
            if name.endswith(RESIDUAL_WRITERS[:2]) or RESIDUAL_WRITERS[2] in name:
                std /= math.sqrt(2 * self.layers_at_base)
        return std

    @property
    def readout(self) -> float:
        """The multiplier of the logits and of each MoE router's logits."""
        return 1.0 / self.width

    @property
    def residual(self) -> float:
        """The multiplier of every block's attention and feed-forward output (the residual
        branches)."""
        return 1.0 / self.depth

    @property
    def attention_scale(self) -> float | None:
        """The attention logits' scale; None: SDPA's own 1 / sqrt(head_dim)."""
        if self.base_head_dim == self.head_dim:
            return None
        return math.sqrt(self.base_head_dim) / self.head_dim

    def forward_multiplier(self, name: str, kind: Kind) -> float:
        """What the forward multiplies a parameter's output by, as describe shows it (the tied
        embedding's readout use aside: `readout`)."""
        if kind is Kind.READOUT:
            return self.readout
        if kind is Kind.HIDDEN and (name.endswith(RESIDUAL_WRITERS[:2])
                                    or RESIDUAL_WRITERS[2] in name):
            return self.residual
        return 1.0

"""The scale site (docs/concepts/scale-vectors.md): a learnable vector s multiplying a tensor
elementwise, built from a row of the scale plan (plan.py, which decides where sites go under a
strategy), and the model's sites seen with the maps they scale.

A site's role (`input`: right before a linear map, absorbable into it; `output`: anything else)
decides weight decay under `iwd` and how it folds. Its parameterization decides how s is computed
from parameters.
"""

from dataclasses import dataclass

import torch
from torch import nn

from scalevec_train.model.config import PARAMS
from scalevec_train.model.plan import Role, Side, SiteRow, site_parameters


class ScaleSite(nn.Module):
    """A learnable scale vector s of `shape` (the last dim is the feature dim; leading dims, e.g.
    one row per expert, each get their own magnitude under `or`/`er`)."""

    def __init__(self, shape: tuple[int, ...], role: str, param: str, behind_norm: bool = False):
        super().__init__()
        assert role in tuple(Role) and param in PARAMS
        self.shape, self.role, self.param = tuple(shape), Role(role), param
        # A site behind a normalization is that normalization's weight: it cannot fold away.
        self.behind_norm = behind_norm
        for name, p_shape in site_parameters(self.shape, param):
            self.register_parameter(name,
                                    nn.Parameter(torch.full(p_shape, self.initial_entry(name))))

    @classmethod
    def of(cls, row: SiteRow) -> "ScaleSite":
        """The site a plan row describes."""
        return cls(row.shape, row.role, row.param, behind_norm=row.behind_norm)

    @property
    def foldable(self) -> bool:
        return self.param != "fixed" and not self.behind_norm

    @staticmethod
    def initial_entry(param_name: str) -> float:
        """Every parameterization starts at s = 1: b = 0, every other parameter 1."""
        return 0.0 if param_name == "b" else 1.0

    @staticmethod
    def initial_value(param_name: str, shape: torch.Size) -> torch.Tensor:
        return torch.full(shape, ScaleSite.initial_entry(param_name))

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            p.fill_(self.initial_entry(name))  # in place: a sharded (DTensor) parameter too

    def forward(self) -> torch.Tensor | None:
        """The vector s, or None for a fixed site (s = 1: callers skip the multiply)."""
        if self.param == "fixed":
            return None
        if self.param == "plain":
            return self.scale
        direction = self.alpha * torch.rsqrt(self.alpha.pow(2).mean(-1, keepdim=True))
        return self.magnitude() * direction

    def magnitude(self) -> torch.Tensor:
        """beta of an or/er site: the learned beta (or) or exp(b) (er)."""
        return self.beta if self.param == "or" else torch.exp(self.b)

    def extra_repr(self) -> str:
        where = ", behind_norm" if self.behind_norm else ""
        return f"shape={self.shape}, role={self.role}, param={self.param}{where}"


@dataclass(frozen=True)
class ScaledMap:
    """A linear map seen from a scale site: its weight ([out, in], or [experts, out, in]) and the
    label of the normalization right after it (None when its output is not normalized on its
    own)."""

    weight: torch.Tensor
    norm: str | None


@dataclass(frozen=True)
class SiteMaps:
    """A site of a model with the maps it scales, as its plan row says: their inputs (side `in`) or
    their outputs (side `out`); `cancelled_by`: the normalizations that cancel its magnitude."""

    site: ScaleSite
    side: Side
    maps: tuple[ScaledMap, ...]
    cancelled_by: str | None


def scale_sites(model: nn.Module) -> list[tuple[str, ScaleSite]]:
    """Every scale site of a model, with its module path."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ScaleSite)]


def site_display_name(path: str) -> tuple[int | None, str]:
    """(layer index or None, the site's name without the layer prefix) for tables and
    diagnostics."""
    parts = path.split(".")
    if parts[0] == "layers":
        return int(parts[1]), ".".join(parts[2:])
    return None, path

"""Scale-vector strategies (docs/scale-vectors.md): the scale site, and the plan that tells the model
which sites exist where under a strategy (ScaleConfig, model/config.py).

A *site* is a learnable vector s multiplying a tensor elementwise. Its role (`input`: right before a
linear map, absorbable into it; `output`: anything else) decides weight decay under `iwd` and how it
folds. Its parameterization decides how s is computed from parameters.
"""

from dataclasses import dataclass

import torch
from torch import nn

from scalevec_train.errors import ScalevecError
from scalevec_train.model.config import PARAMS, ScaleConfig

ROLES = ("input", "output")
# Forward FLOPs per element and token (accounting.py): a normalization (square-accumulate, scale by the
# inverse RMS, and the RMS itself amortized) and a scale site (one multiply).
NORM_FLOPS, SITE_FLOPS = 3, 1


class ScaleSite(nn.Module):
    """A learnable scale vector s of `shape` (the last dim is the feature dim; leading dims, e.g. one
    row per expert, each get their own magnitude under `or`/`er`)."""

    def __init__(self, shape: tuple[int, ...], role: str, param: str, behind_norm: bool = False):
        super().__init__()
        assert role in ROLES and param in PARAMS
        self.shape, self.role, self.param = tuple(shape), role, param
        # A site behind a normalization is that normalization's weight: it cannot fold away.
        self.behind_norm = behind_norm
        magnitude_shape = self.shape[:-1] + (1,)
        if param == "plain":
            self.scale = nn.Parameter(torch.ones(self.shape))
        elif param == "or":
            self.beta = nn.Parameter(torch.ones(magnitude_shape))
            self.alpha = nn.Parameter(torch.ones(self.shape))
        elif param == "er":
            self.b = nn.Parameter(torch.zeros(magnitude_shape))
            self.alpha = nn.Parameter(torch.ones(self.shape))

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

    def flops_per_token(self, width: int | None = None) -> int:
        """Forward FLOPs per token of applying s to `width` features (default: its own last dim; a
        head_dim site is broadcast over the heads); none for a fixed site."""
        return 0 if self.param == "fixed" else SITE_FLOPS * (width or self.shape[-1])

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
    """A linear map seen from a scale site: its weight ([out, in], or [experts, out, in]) and the label
    of the normalization right after it (None when its output is not normalized on its own)."""

    weight: torch.Tensor
    norm: str | None


@dataclass(frozen=True)
class SiteMaps:
    """The maps a site scales: their inputs (side `in`: W <- W diag(s) folds it) or their outputs
    (side `out`: W <- diag(s) W, unless the site sits behind a normalization)."""

    site: ScaleSite
    side: str
    maps: tuple[ScaledMap, ...]

    @property
    def cancelled_by(self) -> str | None:
        """The normalization(s) that cancel the site's overall magnitude: an input site whose every map
        is normalized right after (docs/scale-vectors.md, "Sites whose magnitude does not reach the loss")."""
        if self.side != "in" or self.site.param == "fixed" or not all(m.norm for m in self.maps):
            return None
        return ", ".join(dict.fromkeys(m.norm for m in self.maps))


@dataclass(frozen=True)
class MapPlan:
    """Where the sites of one linear map go (plan_map): an optional new input site, an optional output normalization
    (`head`: per attention head, `full`: over the whole output) and an optional output site."""

    in_site: bool = False
    out_norm: str | None = None
    out_site: bool = False


def plan_map(scale: ScaleConfig, name: str, qk_norm: bool, post_norm: bool) -> MapPlan:
    """Where the sites of linear map `name` go under `scale` on a model with the given options.

    dual_norm reuses the model's own QK-norm / post-norms: it never stacks a second normalization.
    """
    model_norm = (name in ("q", "k") and qk_norm) or (name in ("o", "down") and post_norm)
    targeted = scale.placement != "pre" and name in scale.targets
    if targeted and scale.placement == "dual" and model_norm:
        raise ScalevecError(
            "scale.placement",
            f"dual placement on '{name}' would put an output site right before the model's own "
            "normalization of that map (qk_norm/post_norm).",
            "use scale.placement=dual_norm (it reuses that normalization), or remove "
            f"'{name}' from scale.targets.")
    has_norm = model_norm or (targeted and scale.placement == "dual_norm")
    out_norm = ("head" if name in ("q", "k", "v") else "full") if has_norm else None
    return MapPlan(
        # q/k/v/gate/up already have the pre-norm's (or their HG branch's) site on their input side.
        in_site=targeted and name in ("o", "down"),
        out_norm=out_norm,
        out_site=has_norm or targeted,
    )


def input_branches(scale: ScaleConfig, sublayer: str, moe: bool = False) -> list[str]:
    """Names of the input sites one pre-norm feeds: a single shared one, or one per branch (HG)."""
    if scale.heterogeneity == "shared":
        return [sublayer]
    if sublayer == "attn":
        return ["q", "k", "v"]
    # Under HG an MoE router gets its own input site. With per-expert sites the experts (and the
    # shared expert) scale their inputs themselves, so the norm hands them N(x) unscaled ("norm").
    if moe:
        return ["router", "norm"] if scale.per_expert else ["gate", "up", "router"]
    return ["gate", "up"]


def scale_sites(model: nn.Module) -> list[tuple[str, ScaleSite]]:
    """Every scale site of a model, with its module path."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ScaleSite)]


def site_display_name(path: str) -> tuple[int | None, str]:
    """(layer index or None, the site's name without the layer prefix) for tables and diagnostics."""
    parts = path.split(".")
    if parts[0] == "layers":
        return int(parts[1]), ".".join(parts[2:])
    return None, path

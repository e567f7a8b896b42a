"""Scale-vector strategies (docs/scale-vectors.md): the config axes, the scale site, and the
plan that tells the model which sites exist where.

A *site* is a learnable vector s multiplying a tensor elementwise. Its role (`input`: right before a
linear map, absorbable into it; `output`: anything else) decides weight decay under `iwd` and how it
folds. Its parameterization decides how s is computed from parameters.
"""

from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import nn

from scalevec_train.errors import ScalevecError, check_choices, choice

ROLES = ("input", "output")
Param = Literal["plain", "or", "er", "fixed"]
PARAMS = get_args(Param)
# The linear maps of a block that placement targets can name.
ATTN_MAPS = ("q", "k", "v", "o")
FFN_MAPS = ("gate", "up", "down")
# The maps that read a pre-norm's output: the default placement targets.
PRE_NORM_MAPS = ("q", "k", "v", "gate", "up")
# Forward FLOPs per element and token (accounting.py): a normalization (square-accumulate, scale by the
# inverse RMS, and the RMS itself amortized) and a scale site (one multiply).
NORM_FLOPS, SITE_FLOPS = 3, 1


@dataclass
class ScaleConfig:
    # preset name; used in run names and for grouping runs
    name: str = "baseline"
    # shared: one pre-norm scale feeds q/k/v (and gate/up); per_branch: one input site per branch (HG)
    heterogeneity: str = choice("shared", Literal["shared", "per_branch"])
    # MoE only, with per_branch: every expert gets its own gate/up input sites
    per_expert: bool = False
    # pre: scales only before the maps; dual: also an output-side site on each target map (DP);
    # dual_norm: the output-side site sits behind a normalization (DNP)
    placement: str = choice("pre", Literal["pre", "dual", "dual_norm"])
    # the linear maps that get dual placement: any of q, k, v, o, gate, up, down. The default is the
    # pre-norm maps (spec revision 2); [q, k, o, down] is revision 1's reading (QK-norm + post-norms)
    targets: list[str] = field(default_factory=lambda: list(PRE_NORM_MAPS))
    # shape of the sites behind per-head normalizations (q, k, v): head_dim (shared by heads) | full
    head_site_shape: str = choice("head_dim", Literal["head_dim", "full"])
    # plain: s = p; or: s = beta * alpha / rms(alpha); er: s = exp(b) * alpha / rms(alpha);
    # fixed: s = 1 with no parameter (the removal ablation)
    reparam: str = choice("plain", Param)
    # which sites `reparam` applies to (the others are plain): all | input | output
    reparam_sites: str = choice("all", Literal["all", "input", "output"])
    # weight decay on scale parameters: none | all | iwd (input sites only)
    weight_decay: str = choice("none", Literal["none", "all", "iwd"])
    # what decay does to an or/er site: magnitude (shrink s by (1 - lr*wd) per step: beta scaled, b
    # shifted by log(1 - lr*wd), alpha untouched) | all_params (revision 1: the optimizer's decay on
    # beta or b and on alpha)
    reparam_decay: str = choice("magnitude", Literal["magnitude", "all_params"])

    def validate(self) -> None:
        check_choices(self, "scale.")
        unknown = [t for t in self.targets if t not in ATTN_MAPS + FFN_MAPS]
        if unknown:
            raise ScalevecError("scale.targets", f"unknown linear maps {unknown}.",
                                f"choose among {', '.join(ATTN_MAPS + FFN_MAPS)}.")
        if self.per_expert and self.heterogeneity != "per_branch":
            raise ScalevecError("scale.per_expert", "per-expert sites need branch-specific scales.",
                                "set scale.heterogeneity=per_branch or scale.per_expert=false.")

    def site_param(self, role: str) -> str:
        """The parameterization of a new site of this role."""
        return self.reparam if self.reparam_sites in ("all", role) else "plain"

    def decays(self, site: "ScaleSite") -> bool:
        """Whether `site` gets weight decay (a fixed site has nothing to decay)."""
        if site.param == "fixed":
            return False
        return self.weight_decay == "all" or (self.weight_decay == "iwd" and site.role == "input")

    def decay_rule(self, site: "ScaleSite", param_name: str) -> str:
        """How weight decay treats parameter `param_name` (scale, beta, b or alpha) of `site`: `scale`
        (p <- p (1 - lr wd), the optimizer's decoupled decay), `log` (b <- b + log(1 - lr wd), shrinking
        exp(b) by the same factor) or `none`. In magnitude mode only an or/er site's magnitude decays, so
        that decay shrinks s itself."""
        if not self.decays(site):
            return "none"
        if self.reparam_decay == "all_params" or param_name in ("scale", "beta"):
            return "scale"
        return "log" if param_name == "b" else "none"


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
    def initial_value(param_name: str, shape: torch.Size) -> torch.Tensor:
        """Every parameterization starts at s = 1: b = 0, every other parameter 1."""
        return torch.zeros(shape) if param_name == "b" else torch.ones(shape)

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            p.copy_(self.initial_value(name, p.shape))

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
        is normalized right after (spec, "Sites whose magnitude does not reach the loss")."""
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

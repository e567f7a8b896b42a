"""The scale plan: every scale site a strategy puts on a model, decided in one place.

`ScalePlan.build(ModelConfig, ScaleConfig)` applies the strategy's rules
(docs/concepts/scale-vectors.md) once and gives one row per site (`SiteRow`), in the model's
parameter order: its module path, shape, role and parameterization; the linear maps it scales and on
which side; the normalization whose output it multiplies; the normalizations that cancel its
magnitude; how it folds; and, per parameter, the decay rule and the optimizer group (every site
group takes optim.scale_lr, optim/groups.py).

The same rows are handed to the layers by part (`PreNormPlan`, `MapPlan`, `SwiGLUPlan`, `MoEPlan`,
`BlockPlan`): each layer builds the sites of its part and nothing else, and reads from it which
pre-norm branch feeds each map. The optimizer's groups, folding, accounting, describe, the memory
estimate and the export read the rows; tests/model/test_plan.py checks that a built model has
exactly the plan's sites.
"""

from dataclasses import dataclass
from enum import StrEnum
from math import prod

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.config import ModelConfig, ScaleConfig


class Branch(StrEnum):
    """The scaled copies of N(x) a pre-norm hands out (one site each)."""

    ATTN = "attn"  # one site shared by q, k and v
    Q = "q"
    K = "k"
    V = "v"
    FFN = "ffn"  # one site shared by gate and up (and an MoE router)
    GATE = "gate"
    UP = "up"
    ROUTER = "router"
    NORM = "norm"  # N(x) itself (a fixed site): for experts that scale their inputs themselves
    FINAL = "final"  # the final norm's, read by the output head


class MapName(StrEnum):
    """The linear maps a site can scale (scale.targets names the first seven)."""

    Q = "q"
    K = "k"
    V = "v"
    O = "o"  # the attention's output map
    GATE = "gate"
    UP = "up"
    DOWN = "down"
    ROUTER = "router"
    HEAD = "head"


class Role(StrEnum):
    INPUT = "input"  # right before a linear map: absorbable into it; what iwd decays
    OUTPUT = "output"  # anything else: after a map, behind a normalization


class Side(StrEnum):
    IN = "in"  # the site scales its maps' inputs: W diag(s)
    OUT = "out"  # their outputs: diag(s) W, or s * N(W .) behind a normalization


class NormKind(StrEnum):
    HEAD = "head"  # per attention head (N_h)
    FULL = "full"  # over the whole width


class Fold(StrEnum):
    COLUMNS = "columns"  # into its maps' columns, W <- W diag(s)
    ROWS = "rows"  # into its maps' rows, W <- diag(s) W
    KEEP = "keep"  # stays: it is a normalization's weight
    NONE = "none"  # fixed: s = 1, nothing to fold


class Decay(StrEnum):
    SCALE = "scale"  # p <- p (1 - lr wd), the optimizer's decoupled decay
    # b <- b + log(1 - lr wd): exp(b) shrinks by the same factor (optim/groups.py's hook)
    LOG = "log"
    NONE = "none"


# The optimizer group of each decay rule (optim/groups.py: every one takes optim.scale_lr as its
# peak LR).
GROUPS = {Decay.SCALE: "scale_decay", Decay.LOG: "scale_log_decay", Decay.NONE: "scale_no_decay"}
HEAD_MAPS = (MapName.Q, MapName.K, MapName.V)  # whose output normalization works per head


def site_parameters(shape: tuple[int, ...], param: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of the parameters of a site of `param` (plain: scale; or: beta, alpha; er: b,
    alpha; fixed: none). A magnitude has one entry per row (per expert) of the site."""
    magnitude = shape[:-1] + (1,)
    return {"plain": (("scale", shape),), "or": (("beta", magnitude), ("alpha", shape)),
            "er": (("b", magnitude), ("alpha", shape)), "fixed": ()}[param]


@dataclass(frozen=True)
class Norm:
    """A normalization: `label` as describe shows it (N(x) for a pre-norm, N_h(q), N(gate)),
    computed by the module at `path` over `width` features, `passes` times per token (top_k inside
    routed experts)."""

    path: str
    label: str
    kind: NormKind
    width: int
    passes: int = 1


@dataclass(frozen=True)
class MapRef:
    """A linear map as a site sees it: its weight's parameter path, and the normalization of its
    output (None when its output is not normalized on its own)."""

    name: MapName
    weight: str
    norm: Norm | None


@dataclass(frozen=True)
class SiteParam:
    name: str
    shape: tuple[int, ...]
    decay: Decay

    @property
    def group(self) -> str:
        return GROUPS[self.decay]


@dataclass(frozen=True)
class SiteRow:
    """One scale site."""

    path: str  # module path, e.g. layers.0.attn.wq.out_site
    shape: tuple[int, ...]  # leading dims: one row per routed expert
    role: Role
    param: str  # plain | or | er | fixed (model.config.Param)
    side: Side
    maps: tuple[MapRef, ...]  # the maps it scales
    norm: Norm | None  # the normalization whose output it multiplies
    width: int  # features it multiplies per pass (a head_dim site: every head's)
    passes: int  # per token
    params: tuple[SiteParam, ...]  # with the optimizer's treatment of each

    @property
    def behind_norm(self) -> bool:
        """An output site behind a normalization is that normalization's weight: it cannot fold
        away."""
        return self.side is Side.OUT and self.norm is not None

    @property
    def fold(self) -> Fold:
        if self.param == "fixed":
            return Fold.NONE
        if self.behind_norm:
            return Fold.KEEP
        return Fold.COLUMNS if self.side is Side.IN else Fold.ROWS

    @property
    def cancelled_by(self) -> str | None:
        """The normalization(s) that cancel the site's overall magnitude: an input-side site whose
        every map is normalized right after (docs/concepts/scale-vectors.md, "Sites whose magnitude
        does not reach the loss")."""
        if self.side is not Side.IN or self.param == "fixed" or not all(m.norm for m in self.maps):
            return None
        return ", ".join(dict.fromkeys(m.norm.label for m in self.maps))

    @property
    def layer(self) -> int | None:
        parts = self.path.split(".")
        return int(parts[1]) if parts[0] == "layers" else None

    @property
    def numel(self) -> int:
        return sum(prod(p.shape) for p in self.params)


@dataclass(frozen=True)
class MapPlan:
    """One linear map [d_out, d_in] and its sites: the pre-norm branch it reads (None: o, down), its
    own input site, the normalization of its output and its output site."""

    ref: MapRef
    d_in: int
    d_out: int
    reads: Branch | None
    in_site: SiteRow | None
    out_norm: NormKind | None
    out_site: SiteRow | None


@dataclass(frozen=True)
class PreNormPlan:
    """N(x), computed once, and one site per branch (in the order the norm hands them out)."""

    norm: Norm
    sites: dict[Branch, SiteRow]


@dataclass(frozen=True)
class AttentionPlan:
    q: MapPlan
    k: MapPlan
    v: MapPlan
    o: MapPlan


@dataclass(frozen=True)
class SwiGLUPlan:
    """gate, up and down of a SwiGLU: the dense feed-forward's maps, or an expert stack's (whose
    input sites under per_expert are its gate's and up's in_site; its down's output side is the MoE
    layer's)."""

    gate: MapPlan
    up: MapPlan
    down: MapPlan


@dataclass(frozen=True)
class MoEPlan:
    """The router (no site of its own), the routed experts, the shared expert, and the output side
    of every expert's down map, which acts on the combined output: its normalization and site."""

    router: MapPlan
    experts: SwiGLUPlan
    shared: SwiGLUPlan | None
    down_norm: NormKind | None
    down_site: SiteRow | None


@dataclass(frozen=True)
class BlockPlan:
    attn_norm: PreNormPlan
    attn: AttentionPlan
    ffn_norm: PreNormPlan
    ffn: SwiGLUPlan | None  # dense
    moe: MoEPlan | None
    rows: tuple[SiteRow, ...]


@dataclass(frozen=True)
class ScalePlan:
    """Every site of a model under a strategy: `rows` in the model's parameter order, and by
    part."""

    blocks: tuple[BlockPlan, ...]
    final_norm: PreNormPlan
    rows: tuple[SiteRow, ...]

    @classmethod
    def build(cls, model: ModelConfig, scale: ScaleConfig, folded: bool = False) -> "ScalePlan":
        """The plan of `model` under `scale`; `folded`: of the folded model (fold.py), whose sites
        that fold are fixed and whose sites behind a normalization are plain."""
        return _Rules(model, scale, folded).plan()

    @property
    def final(self) -> SiteRow:
        return self.final_norm.sites[Branch.FINAL]

    def site_parameters(self) -> dict[str, SiteParam]:
        """{parameter name in the model: its treatment} of every site parameter."""
        return {f"{row.path}.{p.name}": p for row in self.rows for p in row.params}


class _Rules:
    """The strategy's rules (docs/concepts/scale-vectors.md, "The strategies"), applied to one
    model."""

    def __init__(self, model: ModelConfig, scale: ScaleConfig, folded: bool):
        self.m, self.s, self.folded = model, scale, folded

    # --- one site ---------------------------------------------------------------------------------

    def site(self, path: str, shape: tuple[int, ...], role: Role, side: Side,
             maps: tuple[MapRef, ...], norm: Norm | None, width: int, passes: int = 1,
             fixed: bool = False, final: bool = False) -> SiteRow:
        param = "fixed" if fixed else self.param(role, side is Side.OUT and norm is not None)
        params = tuple(SiteParam(name, p_shape, self.decay(role, param, name, final))
                       for name, p_shape in site_parameters(shape, param))
        return SiteRow(path, shape, role, param, side, maps, norm, width, passes, params)

    def param(self, role: Role, behind_norm: bool) -> str:
        """scale.reparam on the sites scale.reparam_sites selects, plain on the others. Folded, a
        site is absorbed into its maps (fixed) or stays as its normalization's plain weight."""
        param = self.s.reparam if self.s.reparam_sites in ("all", role) else "plain"
        if self.folded and param != "fixed":
            return "plain" if behind_norm else "fixed"
        return param

    def decay(self, role: Role, param: str, name: str, final: bool) -> Decay:
        """How weight decay treats parameter `name` of a site: the policy (none, all, iwd: input
        sites only; the final norm's site only with scale.decay_final_norm) picks the sites; in
        magnitude mode only an or/er site's magnitude decays, so that decay shrinks s itself."""
        s = self.s
        decays = param != "fixed" and not (final and not s.decay_final_norm) and (
            s.weight_decay == "all" or (s.weight_decay == "iwd" and role is Role.INPUT))
        if not decays:
            return Decay.NONE
        if s.reparam_decay == "all_params" or name in ("scale", "beta"):
            return Decay.SCALE
        return Decay.LOG if name == "b" else Decay.NONE

    # --- one linear map ---------------------------------------------------------------------------

    def targeted(self, name: MapName) -> bool:
        return self.s.placement != "pre" and name in self.s.targets

    def gets_input_site(self, name: MapName) -> bool:
        """A targeted o or down: q, k, v, gate and up have the pre-norm's (or their HG branch's)
        site on their input side already."""
        return self.targeted(name) and name in (MapName.O, MapName.DOWN)

    def out_norm(self, name: MapName) -> NormKind | None:
        """The normalization of map `name`'s output: the model's own (QK-norm, post-norms), or the
        one dual_norm puts on a target (behind q, k, v per head unless scale.qkv_norm is full).
        dual_norm reuses the model's: it never stacks a second one."""
        own = (name in (MapName.Q, MapName.K) and self.m.qk_norm) or (
            name in (MapName.O, MapName.DOWN) and self.m.post_norm)
        if own and self.targeted(name) and self.s.placement == "dual":
            raise ScalevecError(
                "scale.placement",
                f"dual placement on '{name}' would put an output site right before the model's own "
                "normalization of that map (qk_norm/post_norm).",
                "use scale.placement=dual_norm (it reuses that normalization), or remove "
                f"'{name}' from scale.targets.")
        if not (own or (self.targeted(name) and self.s.placement == "dual_norm")):
            return None
        per_head = name in HEAD_MAPS and (own or self.s.qkv_norm == "head")
        return NormKind.HEAD if per_head else NormKind.FULL

    def map(self, name: MapName, module: str, weight: str, d_in: int, d_out: int,
            reads: Branch | None, in_path: str, out_path: str, rows: tuple[int, ...] = (),
            passes: int = 1, own_input: Norm | None = None) -> MapPlan:
        """Map `name` [d_out, d_in] (the module at `module`, its weight at `weight`) with `rows`
        leading dims on its sites (one per routed expert). Its own input site: gets_input_site, or
        an expert's under per_expert (`own_input`: the normalization whose output it scales). Its
        output site: on a target, and behind every normalization of its output; one of head_dim
        entries behind a per-head normalization unless scale.head_site_shape is full."""
        kind = self.out_norm(name)
        label = f"N_h({name})" if kind is NormKind.HEAD else f"N({name})"
        norm = Norm(module, label, kind, d_out, passes) if kind else None
        ref = MapRef(name, weight, norm)
        in_site = None
        if own_input is not None or self.gets_input_site(name):
            in_site = self.site(in_path, rows + (d_in,), Role.INPUT, Side.IN, (ref,), own_input,
                                d_in, passes)
        out_site = None
        if kind or self.targeted(name):
            per_head = kind is NormKind.HEAD and self.s.head_site_shape == "head_dim"
            shape = rows + ((self.m.head_dim,) if per_head else (d_out,))
            out_site = self.site(out_path, shape, Role.OUTPUT, Side.OUT, (ref,), norm,
                                 d_out, passes)
        return MapPlan(ref, d_in, d_out, reads, in_site, kind, out_site)

    def linear(self, prefix: str, name: MapName, d_in: int, d_out: int,
               reads: Branch | None) -> MapPlan:
        """A Linear module (layers.py) at `prefix`: weight, in_site, out_site."""
        return self.map(name, prefix, f"{prefix}.weight", d_in, d_out, reads, f"{prefix}.in_site",
                        f"{prefix}.out_site")

    # --- the parts --------------------------------------------------------------------------------

    def norm_x(self, path: str) -> Norm:
        """The normalization of the residual stream by the pre-norm at `path`."""
        return Norm(path, "N(x)", NormKind.FULL, self.m.dim)

    def pre_norm(self, path: str, maps: dict[Branch, list[MapRef]],
                 final: bool = False) -> PreNormPlan:
        norm = self.norm_x(path)
        return PreNormPlan(norm, {b: self.site(f"{path}.sites.{b}", (self.m.dim,), Role.INPUT,
                                               Side.IN, tuple(refs), norm, self.m.dim,
                                               fixed=b is Branch.NORM, final=final)
                                  for b, refs in maps.items()})

    def branches(self, sublayer: Branch) -> list[Branch]:
        """The input sites one pre-norm feeds: a single shared one, or one per branch (HG). Under HG
        an MoE router gets its own; with per-expert sites the experts (and the shared expert) scale
        their inputs themselves, so the norm hands them N(x) unscaled (NORM)."""
        if self.s.heterogeneity == "shared":
            return [sublayer]
        if sublayer is Branch.ATTN:
            return [Branch.Q, Branch.K, Branch.V]
        if self.m.moe is not None:
            return ([Branch.ROUTER, Branch.NORM] if self.s.per_expert
                    else [Branch.GATE, Branch.UP, Branch.ROUTER])
        return [Branch.GATE, Branch.UP]

    def attention(self, prefix: str) -> tuple[list[Branch], AttentionPlan]:
        m = self.m
        branches = self.branches(Branch.ATTN)
        q_width, kv_width = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
        maps = [self.linear(f"{prefix}.w{name}", name, m.dim, width, _reads(branches, Branch(name)))
                for name, width in ((MapName.Q, q_width), (MapName.K, kv_width),
                                    (MapName.V, kv_width))]
        o = self.linear(f"{prefix}.wo", MapName.O, q_width, m.dim, None)
        return branches, AttentionPlan(*maps, o)

    def swiglu(self, prefix: str, hidden: int, reads: tuple[Branch, Branch],
               experts: int | None = None, passes: int = 1,
               pre_norm: Norm | None = None) -> SwiGLUPlan:
        """The dense feed-forward's Linear maps, or (`pre_norm` given) an expert stack's: its
        weights w_gate, w_up, w_down (the shared expert's nn.Linear weights, experts=None) and its
        sites gate_in, up_in, gate_out, up_out, down_in."""
        dim = self.m.dim
        if pre_norm is None:
            return SwiGLUPlan(self.linear(f"{prefix}.w_gate", MapName.GATE, dim, hidden, reads[0]),
                              self.linear(f"{prefix}.w_up", MapName.UP, dim, hidden, reads[1]),
                              self.linear(f"{prefix}.w_down", MapName.DOWN, hidden, dim, None))
        rows = (experts,) if experts else ()
        suffix = "" if experts else ".weight"
        own_input = pre_norm if self.s.per_expert else None
        gate, up = (self.map(name, prefix, f"{prefix}.w_{name}{suffix}", dim, hidden, branch,
                             f"{prefix}.{name}_in", f"{prefix}.{name}_out", rows, passes, own_input)
                    for name, branch in ((MapName.GATE, reads[0]), (MapName.UP, reads[1])))
        # An expert's down output is not normalized on its own: the MoE layer's output side acts on
        # the sum.
        down = MapRef(MapName.DOWN, f"{prefix}.w_down{suffix}", None)
        down_in = None
        if self.gets_input_site(MapName.DOWN):
            down_in = self.site(f"{prefix}.down_in", rows + (hidden,), Role.INPUT, Side.IN, (down,),
                                None, hidden, passes)
        return SwiGLUPlan(gate, up, MapPlan(down, hidden, dim, None, down_in, None, None))

    def moe(self, prefix: str, branches: list[Branch], pre_norm: Norm) -> MoEPlan:
        m, moe = self.m, self.m.moe
        router = MapPlan(MapRef(MapName.ROUTER, f"{prefix}.router.weight", None), m.dim,
                         moe.num_experts, _reads(branches, Branch.ROUTER), None, None, None)
        reads = (_reads(branches, Branch.GATE), _reads(branches, Branch.UP))
        experts = self.swiglu(f"{prefix}.experts", moe.expert_dim, reads, moe.num_experts,
                              moe.top_k, pre_norm)
        shared = None
        if moe.num_shared_experts:
            width = moe.num_shared_experts * (moe.shared_expert_dim or m.ffn_dim)
            shared = self.swiglu(f"{prefix}.shared", width, reads, pre_norm=pre_norm)
        downs = tuple(part.down.ref for part in (experts, shared) if part is not None)
        kind = self.out_norm(MapName.DOWN)
        site = None
        if kind or self.targeted(MapName.DOWN):
            norm = Norm(prefix, "N(down)", kind, m.dim) if kind else None
            site = self.site(f"{prefix}.down_out", (m.dim,), Role.OUTPUT, Side.OUT, downs,
                             norm, m.dim)
        return MoEPlan(router, experts, shared, kind, site)

    def block(self, i: int) -> BlockPlan:
        prefix = f"layers.{i}"
        attn_branches, attn = self.attention(f"{prefix}.attn")
        attn_maps = (attn.q, attn.k, attn.v)
        attn_norm = self.pre_norm(f"{prefix}.attn_norm",
                                  {b: [p.ref for p in attn_maps if p.reads is b]
                                    for b in attn_branches})
        ffn_branches = self.branches(Branch.FFN)
        ffn = moe = None
        if self.m.moe is None:
            ffn = self.swiglu(f"{prefix}.ffn", self.m.ffn_dim, (_reads(ffn_branches, Branch.GATE),
                                                                _reads(ffn_branches, Branch.UP)))
            readers = [ffn.gate, ffn.up]
            ffn_rows = [site for p in (ffn.gate, ffn.up, ffn.down)
                        for site in (p.in_site, p.out_site)]
        else:
            moe = self.moe(f"{prefix}.ffn", ffn_branches, self.norm_x(f"{prefix}.ffn_norm"))
            parts = [part for part in (moe.experts, moe.shared) if part is not None]
            readers = [moe.router] + [part.gate for part in parts] + [part.up for part in parts]
            ffn_rows = [site for part in parts
                        for site in (part.gate.in_site, part.up.in_site, part.gate.out_site,
                                     part.up.out_site, part.down.in_site)]
            ffn_rows.append(moe.down_site)
        ffn_norm = self.pre_norm(f"{prefix}.ffn_norm", {b: [p.ref for p in readers if p.reads is b]
                                                         for b in ffn_branches})
        rows = [*attn_norm.sites.values(), *(site for p in (*attn_maps, attn.o)
                                             for site in (p.in_site, p.out_site)),
                *ffn_norm.sites.values(), *ffn_rows]
        return BlockPlan(attn_norm, attn, ffn_norm, ffn, moe,
                         tuple(r for r in rows if r is not None))

    def plan(self) -> ScalePlan:
        blocks = tuple(self.block(i) for i in range(self.m.n_layers))
        head = MapRef(MapName.HEAD, "tok_emb.weight" if self.m.tie_embeddings else "head.weight",
                      None)
        final = self.pre_norm("final_norm", {Branch.FINAL: [head]}, final=True)
        return ScalePlan(blocks, final,
                         tuple(r for b in blocks for r in b.rows) + (final.sites[Branch.FINAL],))


def _reads(branches: list[Branch], own: Branch) -> Branch:
    """The branch a map reads: its own (HG) or the one its pre-norm shares."""
    if own in branches:
        return own
    return next(b for b in branches if b in (Branch.ATTN, Branch.FFN, Branch.NORM))

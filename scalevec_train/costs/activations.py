"""Activation memory of a training forward, counted from the model and strategy configs alone: the
bytes autograd keeps for the backward pass, per token, per block and around the blocks.

It follows the forward of model/transformer.py, model/layers.py and model/moe.py tensor by tensor,
with the sites and normalizations of the model's scale plan (model/plan.py):
every op that keeps an input or output for its backward adds that tensor once (a tensor kept by
several ops, e.g. the pre-norm output read by q, k and v, counts once). What is kept depends on the
precision and the kernels:

  Precision.cpu()   fp32 everywhere, PyTorch reference norms (they keep the fp32 normalized copy
                    as well as the input and 1/rms).
  Precision.gpu()   bf16 autocast (matmul inputs and outputs bf16), the Triton norm kernels (they
                    keep only the input and 1/rms), the residual stream in bf16 (one precision
                    regime on one process and under FSDP: docs/concepts/architecture.md,
                    "Precision"); the weights the forward reads are FSDP's bf16 copies, or the fp32
                    master weights on one process.

Besides the per-token tensors, a forward keeps copies of weights (weight_copy_bytes): the bf16
casts autocast makes of fp32 weights on one process, and the MoE expert weights with their sites
folded in. Smaller per-step tensors (the reparameterized scale vectors) are left out. Activation
checkpointing (parallel/wrap.py) changes what a block keeps: `full` keeps its inputs, `selective`
its inputs and the outputs of the matmuls and attention; both recompute the rest of one block at a
time in the backward pass (`recompute`).
"""

from dataclasses import dataclass

from scalevec_train.model.config import ModelConfig
from scalevec_train.model.plan import (
    AttentionPlan,
    BlockPlan,
    Branch,
    MapPlan,
    MoEPlan,
    NormKind,
    PreNormPlan,
    SiteRow,
    SwiGLUPlan,
)
from scalevec_train.model.transformer import Transformer

INDEX = 8  # int64 indices (tokens, targets, expert order)
FP32 = 4


@dataclass(frozen=True)
class Precision:
    compute: int  # bytes of a matmul's inputs and outputs
    stream: int  # bytes of the residual stream and of the norms' inputs and outputs
    weights: int  # bytes of the weights the forward reads (FSDP's compute-dtype copies, or fp32)
    fused: bool  # the Triton norm kernels (keep input and 1/rms) instead of the PyTorch reference

    @classmethod
    def cpu(cls, bf16: bool = False) -> "Precision":
        """One process on the CPU: fp32, or bf16 autocast (train.dtype=bf16) with the reference
        norms."""
        compute = 2 if bf16 else FP32
        return cls(compute=compute, stream=compute, weights=FP32, fused=False)

    @classmethod
    def gpu(cls, sharded: bool, bf16: bool = True, fused: bool = True) -> "Precision":
        compute = 2 if bf16 else FP32
        return cls(compute=compute, stream=compute, weights=compute if sharded else FP32,
                   fused=fused)


class _Saved:
    """Tensors kept for the backward, by name (a name counts once), in bytes per token."""

    def __init__(self, p: Precision):
        self.p, self.bytes = p, {}

    def keep(self, name: str, nbytes: float) -> None:
        self.bytes.setdefault(name, nbytes)

    def total(self) -> float:
        return sum(self.bytes.values())

    def norm(self, x: tuple[str, int], width: int, rows: int = 1, scaled: bool = True) -> None:
        """rms_norm_scales / head_rms_norm of tensor x = (name, bytes per element), `rows` norms of
        `width` / rows features per token; scaled: some output multiplies a scale vector."""
        name, size = x
        # the kernels keep x; the reference keeps x.float() (x itself when it is fp32)
        if self.p.fused or size == FP32:
            self.keep(name, size * width)
        else:
            self.keep(f"{name}.f32", FP32 * width)
        self.keep(f"{name}.rstd", FP32 * rows)
        if not self.p.fused and scaled:
            self.keep(f"{name}.normed", FP32 * width)

    def matmul(self, x: tuple[str, int], width: int, owner: str) -> None:
        """A matmul keeps its input in the compute dtype: x itself, or its own cast copy."""
        name, size = x
        if size == self.p.compute:
            self.keep(name, size * width)
        else:
            self.keep(f"{name}.cast.{owner}", self.p.compute * width)


def _multiplies(site: SiteRow | None) -> bool:
    """Whether a site multiplies (a fixed site is s = 1 and skipped)."""
    return site is not None and site.param != "fixed"


def _linear(s: _Saved, plan: MapPlan, x: tuple[str, int], m: ModelConfig,
            prefix: str) -> tuple[str, int]:
    """Linear.forward (model/layers.py): input site, the map, output norm or site."""
    name, d_in, d_out = plan.ref.name, plan.d_in, plan.d_out
    if _multiplies(plan.in_site):
        s.keep(x[0], x[1] * d_in)
        x = (f"{prefix}{name}.in", x[1])
    s.matmul(x, d_in, f"{prefix}{name}")
    y = (f"{prefix}{name}.y", s.p.compute)
    scaled = _multiplies(plan.out_site)
    if plan.out_norm is not None:
        s.norm(y, d_out, rows=d_out // m.head_dim if plan.out_norm is NormKind.HEAD else 1,
               scaled=scaled)
        return (f"{prefix}{name}.out", s.p.compute)
    if scaled:
        s.keep(y[0], y[1] * d_out)
        return (f"{prefix}{name}.out", s.p.compute)
    return y


def _swiglu(s: _Saved, gate: tuple[str, int], up: tuple[str, int], width: int, rows: int = 1,
            norms: bool = False, scaled: bool = False, per_expert_scales: bool = False) -> None:
    """silu(gate) * up on `rows` rows of width / rows per token, or swiglu_norm's u_g N(gate), u_u
    N(up) first (norms; scaled: with scales, one row per expert under per_expert_scales)."""
    if not norms:
        s.keep(gate[0], gate[1] * width)
        s.keep(f"{gate[0]}.silu", s.p.compute * width)
        s.keep(up[0], up[1] * width)
        return
    if s.p.fused:
        s.keep(gate[0], gate[1] * width)
        s.keep(up[0], up[1] * width)
        s.keep(f"{gate[0]}.rstd", 2 * FP32 * rows)
        return
    for t in (gate, up):
        s.norm(t, width, rows=rows, scaled=scaled)
        if scaled and per_expert_scales:  # each row's expert's scale row, gathered
            s.keep(f"{t[0]}.rows", FP32 * width)
        s.keep(f"{t[0]}.out", s.p.compute * width)
    s.keep(f"{gate[0]}.silu", s.p.compute * width)


def _norm_outputs(s: _Saved, x: tuple[str, int], m: ModelConfig, plan: PreNormPlan,
                  prefix: str) -> dict[Branch, tuple[str, int]]:
    """A pre-norm of the residual stream and its scaled copy per branch (fixed: N(x) itself)."""
    scaled = {b: _multiplies(site) for b, site in plan.sites.items()}
    s.norm(x, m.dim, scaled=any(scaled.values()))
    return {b: (f"{prefix}{b}" if scaled[b] else f"{x[0]}.normed", s.p.stream) for b in plan.sites}


def _attention(s: _Saved, a: dict, m: ModelConfig, plan: AttentionPlan, prefix: str) -> None:
    q_width, kv_width = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    _linear(s, plan.q, a[plan.q.reads], m, prefix)
    _linear(s, plan.k, a[plan.k.reads], m, prefix)
    v = _linear(s, plan.v, a[plan.v.reads], m, prefix)
    c = s.p.compute
    # flash attention keeps rope(q), rope(k), v, its output and the log-sum-exp per head (fp32);
    # RoPE itself keeps nothing (its cos/sin are buffers)
    s.keep(f"{prefix}q.rope", c * q_width)
    s.keep(f"{prefix}k.rope", c * kv_width)
    s.keep(v[0], c * kv_width)
    s.keep(f"{prefix}attn.lse", FP32 * m.n_heads)
    _linear(s, plan.o, (f"{prefix}attn.out", c), m, prefix)


def _feed_forward(s: _Saved, b: dict, m: ModelConfig, plan: SwiGLUPlan, prefix: str) -> None:
    fused = plan.gate.out_norm == plan.up.out_norm == NormKind.FULL
    if fused:  # swiglu_norm reads the maps' raw outputs
        for p in (plan.gate, plan.up):
            s.matmul(b[p.reads], m.dim, f"{prefix}{p.ref.name}")
        gate, up = (f"{prefix}gate.y", s.p.compute), (f"{prefix}up.y", s.p.compute)
    else:
        gate = _linear(s, plan.gate, b[plan.gate.reads], m, prefix)
        up = _linear(s, plan.up, b[plan.up.reads], m, prefix)
    _swiglu(s, gate, up, m.ffn_dim, norms=fused, scaled=_multiplies(plan.gate.out_site))
    _linear(s, plan.down, (f"{prefix}hidden", s.p.compute), m, prefix)


def _expert_swiglu(s: _Saved, x_gate, x_up, m: ModelConfig, plan: SwiGLUPlan, rows: int,
                   per_expert: bool, prefix: str) -> None:
    """An expert (stack)'s SwiGLU on `rows` rows per token (top_k for the routed experts): input,
    gate/up (their sites folded into the weights, their norms on the outputs), hidden, down input.
    per_expert: the output sites have one row per expert."""
    c, width = s.p.compute, plan.gate.d_out
    s.keep(x_gate[0], x_gate[1] * m.dim * rows)
    s.keep(x_up[0], x_up[1] * m.dim * rows)
    normed = {"gate": plan.gate.out_norm is not None, "up": plan.up.out_norm is not None}
    scaled = _multiplies(plan.gate.out_site) or _multiplies(plan.up.out_site)
    fused = normed["gate"] and normed["up"]
    gate, up = (f"{prefix}gate", c), (f"{prefix}up", c)
    if fused:
        _swiglu(s, gate, up, width * rows, rows, norms=True, scaled=scaled,
                per_expert_scales=per_expert)
        return
    outs = {}
    for n, t in (("gate", gate), ("up", up)):
        if normed[n]:
            s.norm(t, width * rows, rows=rows, scaled=scaled and not per_expert)
            if scaled and per_expert:
                s.keep(f"{t[0]}.rows", FP32 * width * rows)
                s.keep(f"{t[0]}.normed", c * width * rows)
            outs[n] = (f"{t[0]}.out", c)
        else:
            outs[n] = t
    _swiglu(s, outs["gate"], outs["up"], width * rows)


def _moe(s: _Saved, b: dict, m: ModelConfig, plan: MoEPlan, prefix: str) -> None:
    """MoEFeedForward.forward (model/moe.py): router (fp32), routed experts on top_k rows per token,
    the shared expert, the fp32 sum and the `down` output norm or site."""
    moe, c = m.moe, s.p.compute
    x_router = b[plan.router.reads]
    s.keep(x_router[0] if x_router[1] == FP32 else f"{x_router[0]}.f32", FP32 * m.dim)
    e, k = moe.num_experts, moe.top_k
    s.keep(f"{prefix}router.logits", FP32 * e)  # z-loss logsumexp
    s.keep(f"{prefix}router.lse", FP32)
    s.keep(f"{prefix}router.scores", FP32 * e)  # softmax / sigmoid output
    s.keep(f"{prefix}router.chosen", INDEX * k)
    s.keep(f"{prefix}router.weights", FP32 * k)
    if moe.renormalize:
        s.keep(f"{prefix}router.weight_sum", FP32)
    x_gate, x_up = b[plan.experts.gate.reads], b[plan.experts.up.reads]
    # the sort by expert, its gathers and their inverse
    for index in ("token_of", "order", "inverse"):
        s.keep(f"{prefix}experts.{index}", INDEX * k)
    xs_gate = (f"{prefix}experts.x_gate", c)
    xs_up = xs_gate if x_up is x_gate else (f"{prefix}experts.x_up", c)
    # the routed experts' sites on hidden units have one row per expert: rows are gathered per token
    _expert_swiglu(s, xs_gate, xs_up, m, plan.experts, k, True, f"{prefix}experts.")
    s.keep(f"{prefix}experts.hidden", c * moe.expert_dim * k)  # times the routing weight
    s.keep(f"{prefix}experts.weights", c * k)
    s.keep(f"{prefix}experts.down_in", c * moe.expert_dim * k)
    if plan.shared is not None:
        width = plan.shared.gate.d_out
        cast = [t if t[1] == c else (f"{t[0]}.cast.{prefix}shared", c) for t in (x_gate, x_up)]
        _expert_swiglu(s, cast[0], cast[1], m, plan.shared, 1, False, f"{prefix}shared.")
        s.keep(f"{prefix}shared.down_in", c * width)
    y = (f"{prefix}moe.y", FP32)  # the fp32 sum over the k experts
    if plan.down_norm is not None:
        s.norm(y, m.dim, scaled=_multiplies(plan.down_site))
    elif _multiplies(plan.down_site):
        s.keep(y[0], FP32 * m.dim)


def block_bytes(m: ModelConfig, plan: BlockPlan, p: Precision) -> float:
    """Bytes per token one block keeps without checkpointing. Its first norm keeps one stream
    tensor: the embedding's output in the first block, the sum x + plus it writes in the others."""
    s = _Saved(p)
    x = ("x", p.stream)
    a = _norm_outputs(s, x, m, plan.attn_norm, "attn_norm.")
    _attention(s, a, m, plan.attn, "")
    b = _norm_outputs(s, ("h", p.stream), m, plan.ffn_norm, "ffn_norm.")
    if plan.moe is None:
        _feed_forward(s, b, m, plan.ffn, "")
    else:
        _moe(s, b, m, plan.moe, "")
    return s.total()


def block_kept_bytes(m: ModelConfig, plan: BlockPlan, p: Precision, mode: str,
                     first: bool) -> float:
    """Bytes per token a checkpointed block keeps through the forward: its inputs (the stream x, and
    the previous block's update), and under `selective` the outputs of its matmuls and attention."""
    inputs = p.stream * m.dim + (0 if first else p.compute * m.dim)
    if mode == "full":
        return inputs
    q_width, kv_width = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    attn = q_width + 2 * kv_width + q_width + m.dim  # q, k, v, attention output, o
    fp32 = m.n_heads  # attention's log-sum-exp
    if m.moe is None:
        ffn = 2 * m.ffn_dim + m.dim
        down = plan.ffn.down
        if not first and down.out_norm is None and not _multiplies(down.out_site):
            # the update is the previous block's down output, kept already
            inputs -= p.compute * m.dim
    else:
        # the router's fp32 logits and the shared expert's matmuls; the experts' grouped matmuls
        # are recomputed
        fp32 += m.moe.num_experts
        ffn = 0
        if m.moe.num_shared_experts:
            width = m.moe.num_shared_experts * (m.moe.shared_expert_dim or m.ffn_dim)
            ffn += 2 * width + m.dim
    return inputs + p.compute * (attn + ffn) + FP32 * fp32


def outer_bytes(m: ModelConfig, final_norm: PreNormPlan, p: Precision) -> float:
    """Bytes per token kept around the blocks: token ids, the final norm, the head's input, and the
    loss's fp32 log-softmax and targets (trainer.cross_entropy upcasts the logits)."""
    s = _Saved(p)
    s.keep("tokens", INDEX)
    out = _norm_outputs(s, ("x_final", p.stream), m, final_norm, "final_norm.")
    s.matmul(out[Branch.FINAL], m.dim, "head")
    s.keep("log_softmax", FP32 * m.vocab_size)
    s.keep("targets", INDEX)
    return s.total()


def logits_peak_bytes(m: ModelConfig, p: Precision) -> float:
    """Bytes per token alive at the loss on top of what is kept: the logits in the compute dtype and
    their fp32 upcast (the same tensor in fp32), then in the backward the fp32 gradient of the
    log-softmax and of the logits."""
    upcast = FP32 if p.compute != FP32 else 0
    return m.vocab_size * max(p.compute + upcast, 2 * FP32)


def weight_copy_bytes(model: Transformer, p: Precision, block: int | None = None) -> float:
    """Bytes of weight copies one forward of `model` (on the meta device), or of its block `block`,
    keeps: a matrix with k >= 1 sites folded in at every forward (an expert's own sites behind no
    normalization, model/swiglu.py) keeps k - 1 fp32 products and its compute-dtype copy; without
    sites, the compute-dtype cast when the weights are stored in another dtype (fp32 weights under
    bf16 autocast on one process; FSDP's bf16 weights need none). The router runs in fp32: a copy of
    bf16 weights."""
    folded: dict[str, int] = {}
    routers = set()
    for plan in model.plan.blocks:
        if plan.moe is None:
            continue
        routers.add(plan.moe.router.ref.weight)
        for part in filter(None, (plan.moe.experts, plan.moe.shared)):
            for m in (part.gate, part.up, part.down):
                sites = (m.in_site, m.out_site)
                folded[m.ref.weight] = sum(1 for x in sites if _multiplies(x) and not x.behind_norm)
    sites = model.plan.site_parameters()
    # an untied embedding is only looked up, never cast
    lookup = "tok_emb.weight" if model.head is not None else None
    total = 0.0
    for name, t in model.named_parameters():
        if (name in sites or name == lookup
                or (block is not None and not name.startswith(f"layers.{block}."))):
            continue
        k = folded.get(name, 0)
        if name in routers:
            total += t.numel() * FP32 if p.weights != FP32 else 0
        elif k > 0:
            total += t.numel() * (FP32 * (k - 1) + p.compute)
        elif p.weights != p.compute:
            total += t.numel() * p.compute
    return total

"""Mixture-of-experts feed-forward layer: a drop-in for the dense SwiGLU block (`model.moe`).

    logits = W_r x_r                         fp32, even under autocast; x_r: the router's input
                                             (under model.parameterization=mup times 1 / m_N:
                                             parameterization.py)
    p      = softmax(logits) | sigmoid(logits)
    chosen = top_k(p + bias)                 the expert bias only chooses, it never weights
    g      = p[chosen], renormalized to sum 1 over the k chosen if `renormalize`
    y      = sum_j g_j E_{chosen_j}(x) + S(x)  summed in fp32; S: the shared expert(s), if any
    out    = u_down * N(y) | u_down * y | y  as the strategy's plan for `down` says

Every expert is a SwiGLU, E_e(x) = W_down,e (silu(W_gate,e x_g) * W_up,e x_u), stored as 3-D weights
[experts, out, in]. Dropless: tokens are sorted by expert and every expert takes all of its tokens,
through torch._grouped_mm or a loop of matmuls. The sort also gives the rows per expert
(sort_by_expert), so routing reads nothing back to the host on the grouped path (bincount would: it
sizes its output by the data); the loop reads the counts once per layer. Under expert parallelism
the parallel layer installs a dispatch (RoutedExperts.dispatch) that runs each sorted row on the
rank holding its expert and brings the output back; routing, counts and losses stay here, on every
rank's own tokens. The routing weight g multiplies an expert's hidden activation (W_down is linear,
so this equals weighting its output); a token's k expert outputs are then summed in fp32. Several
shared experts act as one SwiGLU of their summed width.

Scale sites (the plan's MoEPlan, plan.py; the experts' SwiGLU builds and applies its own:
swiglu.py): the pre-norm hands this layer the branch FFN (one site read by the router and all
experts), GATE, UP and ROUTER under HG, or ROUTER and NORM with `per_expert`, where the experts
scale N(x) themselves with (experts, dim) sites and the shared expert with (dim,) ones; the plan
says which branch each map reads. Sites on an expert's hidden units (gate/up output sites under dual
placement, the input site of a targeted down map) have one row per routed expert, (experts, width):
hidden unit j of one expert has nothing to do with unit j of another. Under dual_norm, gate and up
are each normalized over the hidden width of their expert, u * N(W x) with the expert's row of u.
Sites that do not sit behind a normalization are applied to the weights, W * s, which is the same
function and cheaper than scaling tokens. The output site of `down` (with its normalization under
dual_norm or post_norm) acts on the combined y, as on the dense block's output.

Load balancing: the auxiliary-loss-free expert bias moves every optimizer step by
bias += bias_update_rate * sign(mean load - load), with the loads (token counts of the step's
training forwards, summed over data-parallel ranks) gathered by update_bias(), which runs after
every optimizer step (Transformer.update_after_step, called by the trainer). Evaluation (eval mode
or no_grad) never counts, so it never moves the bias. Optionally a load-balancing loss
E * sum_e f_e P_e (f_e: share of the micro-batch's assignments going to e, P_e: mean routing
probability of e; 1 when balanced) and the router z-loss mean(logsumexp(logits)^2) are added to the
training loss (Transformer.auxiliary_loss). Each layer reports its load balance through
compute_metrics().
"""

import math
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scalevec_kernels import rms_norm_scales
from scalevec_train.model.config import ModelConfig
from scalevec_train.model.parameterization import Parameterization
from scalevec_train.model.plan import Branch, MoEPlan, SwiGLUPlan
from scalevec_train.model.strategies import ScaleSite
from scalevec_train.model.swiglu import ExpertSwiGLU


def _compute_dtype(w: torch.Tensor, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return w.dtype


def _grouped_mm_supported(x: torch.Tensor, widths: tuple[int, ...]) -> bool:
    """Whether backend=auto uses torch._grouped_mm for x (already in the compute dtype)."""
    if not hasattr(torch, "_grouped_mm") or any(n * x.element_size() % 16 for n in widths):
        return False
    if x.device.type == "cuda":
        # Other GPUs run torch's own fallback loop (with a host sync): no gain over ours.
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    if x.device.type == "cpu":
        # Eager CPU takes fp32 too, but the op's compile-time checks accept bf16 only.
        return x.dtype == torch.bfloat16 or (x.dtype == torch.float32
                                             and not torch.compiler.is_compiling())
    return False


def sort_by_expert(chosen: torch.Tensor,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, expert_of, counts) of the assignments chosen [tokens, k], flattened: the stable order
    that sorts them by expert, each sorted row's expert, and the rows per expert [E]. The counts
    come from the sorted experts (where each expert's rows start), so their size is E whatever the
    data: no host read."""
    flat = chosen.flatten()
    order = flat.argsort(stable=True)
    expert_of = flat.index_select(0, order)
    starts = torch.searchsorted(expert_of, torch.arange(num_experts + 1, device=flat.device,
                                                        dtype=flat.dtype))
    return order, expert_of, starts[1:] - starts[:-1]


def _expert_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               sizes: list[int] | None) -> torch.Tensor:
    """Rows of x sorted by expert times each expert's matrix: x [rows, in], w [E, out, in]; through
    torch._grouped_mm (offsets: int32 end row of each expert) when `sizes` (rows per expert, for the
    loop) is None."""
    if sizes is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    chunks = x.split(sizes)
    return torch.cat([F.linear(chunk, w[e]) for e, chunk in enumerate(chunks)])


@torch.compiler.disable
def _outside_graph(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """`module(*args)`, run eagerly where a compiled block calls it: dispatched experts' all-to-alls
    have data-dependent splits, and their own FSDP hooks cannot be traced; the block compiles around
    the call (wrap.py)."""
    return module(*args)


class ExpertDispatch(Protocol):
    """Runs a token's routed experts where they live (installed as RoutedExperts.dispatch by the
    parallel layer: expert parallelism); the model itself never communicates."""

    def __call__(self, experts: "RoutedExperts", xs_gate: torch.Tensor, xs_up: torch.Tensor,
                 gates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The outputs of RoutedExperts.compute for the rows given (sorted by expert, `counts` per
        expert, gates: their routing weights), in the same order."""
        ...


class RoutedExperts(ExpertSwiGLU):
    """The E routed SwiGLU experts, as weight stacks w_gate, w_up [E, expert_dim, dim] and
    w_down [E, dim, expert_dim]. `dispatch` None: every expert runs here, on this rank's tokens."""

    dispatch: ExpertDispatch | None = None

    def __init__(self, cfg: ModelConfig, plan: SwiGLUPlan):
        super().__init__()
        moe = cfg.moe
        self.backend = moe.backend
        self.w_gate = nn.Parameter(torch.empty(moe.num_experts, moe.expert_dim, cfg.dim))
        self.w_up = nn.Parameter(torch.empty(moe.num_experts, moe.expert_dim, cfg.dim))
        self.w_down = nn.Parameter(torch.empty(moe.num_experts, cfg.dim, moe.expert_dim))
        self.add_sites(plan, cfg)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w_gate, self.w_up, self.w_down

    def per_expert_numel(self) -> int:
        """Parameters that belong to one expert each (what a token skips when not routed there): the
        stacks and every site, each one row per expert."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, x_gate: torch.Tensor, x_up: torch.Tensor, weights: torch.Tensor,
                order: torch.Tensor, expert_of: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x_*: [tokens, dim]; weights: [tokens, k]; order, expert_of, counts: sort_by_expert's of
        the chosen experts [tokens, k]. Returns sum_j weights_j E_{chosen_j}(x) per token, in
        fp32."""
        tokens, k = weights.shape
        token_of = order // k
        dtype = _compute_dtype(self.w_gate, x_gate.device)
        xs_gate = x_gate.to(dtype).index_select(0, token_of)
        xs_up = xs_gate if x_up is x_gate else x_up.to(dtype).index_select(0, token_of)
        gates = weights.flatten().index_select(0, order).to(dtype)
        if self.dispatch is None:
            out = self.compute(xs_gate, xs_up, gates, counts, expert_of, self.weights())
        else:
            out = self.dispatch(self, xs_gate, xs_up, gates, counts)
        # Back to token order (a permutation: no atomics, so deterministic), then the fp32 sum over
        # k.
        inverse = torch.empty_like(order).scatter_(0, order,
                                                   torch.arange(order.numel(), device=order.device))
        return out.index_select(0, inverse).view(tokens, k, -1).sum(1, dtype=torch.float32)

    def compute(self, xs_gate: torch.Tensor, xs_up: torch.Tensor, gates: torch.Tensor,
                counts: torch.Tensor, expert_of: torch.Tensor,
                stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                rows: slice | None = None) -> torch.Tensor:
        """gates_i E_{expert_of_i}(x_i) for rows sorted by expert (`counts` rows per expert, in the
        compute dtype), with the weight stacks `stacks` of those experts: all of them, or (an
        expert-parallel rank's) the experts `rows` of the sites."""
        dtype = xs_gate.dtype
        w_gate, w_up, w_down = (w.to(dtype) for w in self.folded_weights(stacks, rows))
        if self.backend == "auto":
            grouped = _grouped_mm_supported(xs_gate, (w_gate.shape[-1], w_gate.shape[-2]))
        else:
            grouped = self.backend == "grouped_mm"
        # One host read for the three matmuls on the loop, and one set of sizes, so that the
        # compiler knows gate and up alike; the grouped path reads nothing.
        sizes = None if grouped else counts.tolist()
        # swiglu_norm: needs each expert's end row
        fused = self.swiglu.gate_normed and self.swiglu.up_normed
        ends = counts.cumsum(0) if grouped or fused else None
        offsets = ends.to(torch.int32) if grouped else None
        gate, up = (_expert_mm(xs_gate, w_gate, offsets, sizes),
                    _expert_mm(xs_up, w_up, offsets, sizes))
        hidden = self.hidden(gate, up, ends, expert_of, rows)
        return _expert_mm(hidden * gates.unsqueeze(-1), w_down, offsets, sizes)


class SharedExpert(ExpertSwiGLU):
    """A dense SwiGLU every token passes through (several shared experts are one of their summed
    width)."""

    def __init__(self, cfg: ModelConfig, plan: SwiGLUPlan):
        super().__init__()
        hidden = plan.gate.d_out
        self.w_gate = nn.Linear(cfg.dim, hidden, bias=False)
        self.w_up = nn.Linear(cfg.dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, cfg.dim, bias=False)
        self.add_sites(plan, cfg)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w_gate.weight, self.w_up.weight, self.w_down.weight

    def forward(self, x_gate: torch.Tensor, x_up: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down = self.folded_weights()
        return F.linear(self.hidden(F.linear(x_gate, w_gate), F.linear(x_up, w_up)), w_down)


class MoEFeedForward(nn.Module):
    """The MoE block: router, routed experts, optional shared expert, and the `down` output
    sites."""

    def __init__(self, cfg: ModelConfig, plan: MoEPlan):
        super().__init__()
        self.cfg = moe = cfg.moe
        self.router = nn.Linear(cfg.dim, moe.num_experts, bias=False)
        self.experts = RoutedExperts(cfg, plan.experts)
        self.shared = None if plan.shared is None else SharedExpert(cfg, plan.shared)
        # The output side of every expert's down map, on the combined output.
        self.down_out = None if plan.down_site is None else ScaleSite.of(plan.down_site)
        self.out_norm = plan.down_norm
        self.eps, self.kernels = cfg.norm_eps, cfg.kernels
        # the router's logits' multiplier (1 but under mup: a readout of the width)
        self.router_scale = Parameterization.of(cfg).readout
        # the pre-norm branches the router, the experts' gate and their up read
        self.reads: tuple[Branch, Branch, Branch] = (plan.router.reads, plan.experts.gate.reads,
                                                     plan.experts.up.reads)
        # Chooses experts only; a checkpointed training state, changed only by update_bias().
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts))
        # Expert assignments of the current optimizer step's training forwards (this rank).
        self.register_buffer("token_counts", torch.zeros(moe.num_experts, dtype=torch.long),
                             persistent=False)
        # The last finished step's counts over all ranks, for metrics.
        self.register_buffer("last_load", torch.zeros(moe.num_experts, dtype=torch.long),
                             persistent=False)
        # Of the last forward: the weighted auxiliary loss to add to the training loss (None when
        # both coefficients are 0), and the unweighted losses for metrics.
        self.aux_loss: torch.Tensor | None = None
        self.lb_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        # The last forward's aux_loss holds an autograd graph, which deepcopy and pickle refuse.
        return {**super().__getstate__(), "aux_loss": None}

    def init_buffers(self) -> None:
        self.expert_bias.zero_()
        self.token_counts.zero_()
        self.last_load.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
        """x [tokens, dim] -> (fp32 logits [tokens, E], fp32 scores, chosen experts [tokens, k],
        fp32 routing weights [tokens, k])."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
            if self.router_scale != 1:
                logits = logits * self.router_scale
        scores = logits.softmax(-1) if self.cfg.score_func == "softmax" else logits.sigmoid()
        chosen = (scores.detach() + self.expert_bias.float()).topk(self.cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.cfg.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights

    def _record_aux(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor) -> None:
        assignments = counts.float() / counts.sum()
        probs = (scores if self.cfg.score_func == "softmax"
                 else scores / scores.sum(-1, keepdim=True))
        lb = self.cfg.num_experts * (assignments * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        self.lb_loss, self.z_loss = lb.detach(), z.detach()
        self.aux_loss = None
        if self.cfg.aux_loss_coef or self.cfg.z_loss_coef:
            self.aux_loss = self.cfg.aux_loss_coef * lb + self.cfg.z_loss_coef * z

    def forward(self, b: dict[Branch, torch.Tensor]) -> torch.Tensor:
        router_in, gate_in, up_in = self.reads
        x_router, x_gate, x_up = b[router_in], b[gate_in], b[up_in]
        dim = x_router.shape[-1]
        flat_gate = x_gate.reshape(-1, dim)
        flat_up = flat_gate if x_up is x_gate else x_up.reshape(-1, dim)
        logits, scores, chosen, weights = self.route(x_router.reshape(-1, dim))
        order, expert_of, counts = sort_by_expert(chosen, self.cfg.num_experts)
        if self.training and torch.is_grad_enabled():
            # Activation checkpointing recomputes this forward and counts again, for every
            # micro-batch alike: the relative loads, all the bias update and metrics use, stay.
            self.token_counts += counts
        self._record_aux(logits, scores, counts)
        args = (flat_gate, flat_up, weights, order, expert_of, counts)
        y = (self.experts(*args) if self.experts.dispatch is None
             else _outside_graph(self.experts, *args))
        if self.shared is not None:
            y = y + self.shared(flat_gate, flat_up).float()
        s = self.down_out() if self.down_out is not None else None
        if self.out_norm is not None:
            y = rms_norm_scales(y, [s], self.eps, backend=self.kernels)[0]
        elif s is not None:
            y = y * s
        return y.to(x_router.dtype).view(x_router.shape)

    @torch.no_grad()
    def update_bias(self, taken: torch.Tensor | None = None) -> None:
        """Once per optimizer step, after the step's forwards: sum the counts over data-parallel
        ranks (a collective: every rank must call it) and move the bias toward balanced loads. Where
        the 0-dim bool `taken` is false (a skipped step), the bias and the last load stay as they
        were."""
        counts = self.token_counts
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        load = counts.float()
        # sign(0) = 0: a step without training forwards leaves the bias alone.
        bias = self.expert_bias + self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        if taken is None:
            self.expert_bias.copy_(bias)
            self.last_load.copy_(counts)
        else:
            torch.where(taken, bias, self.expert_bias, out=self.expert_bias)
            torch.where(taken, counts, self.last_load, out=self.last_load)
        counts.zero_()

    @torch.no_grad()
    def compute_metrics(self) -> dict[str, float]:
        """Expert load of the last finished step (max and min share of the assignments, entropy
        normalized to 1 for a perfect balance), the unweighted losses of the last forward, and the
        range of the expert bias."""
        out = {}
        load = self.last_load.float()
        if load.sum() > 0:
            share = load / load.sum()
            out["load_max"] = share.max().item()
            out["load_min"] = share.min().item()
            entropy = torch.special.entr(share).sum().item()
            out["load_entropy"] = entropy / math.log(len(share)) if len(share) > 1 else 1.0
        if self.lb_loss is not None:
            out["lb_loss"] = self.lb_loss.item()
            out["z_loss"] = self.z_loss.item()
        out["bias_min"] = self.expert_bias.min().item()
        out["bias_max"] = self.expert_bias.max().item()
        return out

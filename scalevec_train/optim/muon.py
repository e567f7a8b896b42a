"""Muon (momentum orthogonalized by Newton-Schulz) for hidden matrices, AdamW for every other
tensor.

One optimizer object holds both kinds of parameter group (`use_muon`), so that the trainer steps,
schedules and checkpoints a single optimizer. On one process the Muon update follows
torch.optim.Muon operation for operation. Under FSDP2 the momentum stays sharded like its parameter
and only the orthogonalization sees whole matrices, on an owner rank (see muon_dist).

A step can be skipped on the device (optim/adamw.py, StepsWhere): step_where(taken). The host never
reads the verdict: every tensor the step changes (parameters, momentum, Adam moments, the step
counters, which live on the device) is computed anew and then selected, element for element, between
the new and the old value; a taken step does the same operations as step(), so its numbers are the
same bit for bit. Groups with a `log_weight_decay` (the `er` sites' magnitudes) are log-decayed
first (log_decay below).
"""

import math

import torch

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.optim.adamw import log_decay
from scalevec_train.optim.muon_dist import orthogonalize_sharded, shard_layout
from scalevec_train.parallel.process_group import local

# Keller Jordan's quintic: a fixed polynomial whose slope at 0 is as large as possible.
QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express, degree 5 (Amsel et al. 2025, arXiv 2505.16932): a polynomial per iteration, the
# last one repeating; all but the last are shrunk by a 1.01 safety factor
# (a/1.01, b/1.01^3, c/1.01^5) for bf16.
_POLAR_EXPRESS_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
POLAR_EXPRESS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]]
POLAR_EXPRESS.append(_POLAR_EXPRESS_RAW[-1])

# The names checkpoints store group keys under: those they were first written with (a distributed
# checkpoint loads only the keys it holds), mapped to and from the names of OptimConfig and the
# groups.
STORED_KEYS = {"betas": "adamw_betas", "eps": "adamw_eps", "ns_eps": "eps"}

NS_COEFFICIENTS = ("quintic", "polar_express")
LR_ADJUSTS = ("match_rms_adamw", "original")
NS_DTYPES = ("bfloat16", "float16", "float32")


def newton_schulz(g: torch.Tensor, steps: int, coefficients: str = "quintic",
                  dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """Approximate the polar factor U V^T of a matrix g = U S V^T, or of each matrix of a batch
    [B, m, n].

    Computed in `dtype` and returned in it. For 2-D input with the quintic coefficients this
    performs torch.optim.Muon's operations in its order, so that bf16 results agree bit for bit.
    """
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT  # the Gram matrix is then the smaller of the two squares
    norm = x.norm() if x.ndim == 2 else x.norm(dim=(-2, -1), keepdim=True)
    if coefficients == "polar_express":
        # Frobenius norm >= spectral norm; the 1.01 margin keeps bf16 rounding from pushing it
        # over 1
        x = x / (norm * 1.01 + eps)
        schedule = [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
    else:
        x = x / norm.clamp(min=eps)
        schedule = [QUINTIC] * steps
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for a, b, c in schedule:
        gram = x @ x.mT
        poly = addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = addmm(x, poly, x, beta=a)  # a X + b X^3 + c X^5
    return x.mT if tall else x


def adjusted_lr(lr: float, rows: int, cols: int, mode: str) -> float:
    """The LR that multiplies a rows x cols orthogonalized update (weight decay uses `lr` itself).

    `match_rms_adamw` gives the update AdamW's typical RMS (Moonshot's rule), so Muon reuses AdamW's
    LR and decay; `original` is Keller Jordan's sqrt(max(1, rows / cols)).
    """
    ratio = (0.2 * math.sqrt(max(rows, cols)) if mode == "match_rms_adamw"
             else math.sqrt(max(1, rows / cols)))
    return lr * ratio


def _renamed(group: dict, names: dict[str, str]) -> dict:
    return {names.get(k, k): v for k, v in group.items()}


def _ns_cost(shape: torch.Size) -> float:
    """Newton-Schulz work for a whole parameter: rows * cols * min(rows, cols) per matrix."""
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2], shape[-1]
    return float(batch * rows * cols * min(rows, cols))


class Muon(torch.optim.Optimizer):
    """Muon for groups with `use_muon=True` (2-D matrices, 3-D expert stacks), AdamW for the others.

    Group keys (each defaults to the constructor argument of the same name, which is OptimConfig's
    option of that name; the AdamW ones are torch.optim.AdamW's):
      use_muon (True): Muon, or AdamW with betas / eps.
      lr, weight_decay: both kinds; weight decay is decoupled and uses the unadjusted LR.
      momentum, nesterov, ns_steps, ns_coefficients, ns_dtype, lr_adjust, ns_eps: Muon only. 3-D
        parameters are a batch of matrices, one per leading index.
    State: Muon params hold `momentum_buffer`; AdamW params `step` (a float32 tensor on the
    parameter's device), `exp_avg`, `exp_avg_sq` (as torch's).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str = "quintic",
        ns_dtype: torch.dtype | str = torch.bfloat16,
        lr_adjust: str = "match_rms_adamw",
        ns_eps: float = 1e-7,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        defaults = dict(use_muon=True, lr=lr, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                        ns_dtype=ns_dtype, lr_adjust=lr_adjust, ns_eps=ns_eps, betas=tuple(betas),
                        eps=eps)
        super().__init__(params, defaults)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["param_groups"] = [_renamed(g, STORED_KEYS) for g in state["param_groups"]]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, under the group keys the state was stored with, then each AdamW step counter
        onto its parameter's device: states saved while the counters lived on the host
        (numbers or CPU tensors) still load."""
        stored = {v: k for k, v in STORED_KEYS.items()}
        groups = [_renamed(g, stored) for g in state_dict["param_groups"]]
        for group in groups:
            group.pop("split", None)  # an option older checkpoints hold, always None
        super().load_state_dict({**state_dict, "param_groups": groups})
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"optim (muon) param group {len(self.param_groups) - 1}"
        # a dtype name keeps the state dict free of torch objects
        if isinstance(group["ns_dtype"], torch.dtype):
            group["ns_dtype"] = str(group["ns_dtype"]).removeprefix("torch.")
        _validate_group(group, where)

    @torch.no_grad()
    def step(self, closure=None):
        log_decay(self.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update(None)
        return loss

    @torch.no_grad()
    def step_where(self, taken: torch.Tensor) -> None:
        log_decay(self.param_groups, taken)
        self._update(taken)

    def _update(self, taken: torch.Tensor | None) -> None:
        """The step's update; with `taken`, each new value selected into place where it is true."""
        # row-sharded matrices wait here, per (shard group, dtypes), for one exchange with their
        # owners
        pending: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, dict]]] = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group, taken)
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = self._momentum_update(p, group, taken)
                layout = shard_layout(p)
                if layout is None:
                    self._apply(p, _orthogonalize(update, group), group, taken)
                else:
                    key = (layout, update.dtype, group["ns_dtype"])
                    pending.setdefault(key, []).append((p, update, group))
        for (layout, _, ns_dtype), items in pending.items():
            def whole(i, matrix, items=items):
                return _orthogonalize(matrix, items[i][2])

            results = orthogonalize_sharded(
                [u for _, u, _ in items], [p.shape[0] for p, _, _ in items],
                [_ns_cost(p.shape) for p, _, _ in items], whole, getattr(torch, ns_dtype), layout)
            for (p, _, group), result in zip(items, results, strict=True):
                self._apply(p, result, group, taken)

    def _momentum_update(self, p: torch.Tensor, group: dict,
                         taken: torch.Tensor | None) -> torch.Tensor:
        """Update the momentum (an EMA of gradients, like torch's); return this rank's part of the
        matrix to orthogonalize: the Nesterov look-ahead, or the momentum itself."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, grad = local(state["momentum_buffer"]), local(p.grad)
        _commit(buf, _candidate(buf, taken).lerp_(grad, 1 - group["momentum"]), taken)
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _apply(self, p: torch.Tensor, ortho: torch.Tensor, group: dict,
               taken: torch.Tensor | None) -> None:
        """Decay, then add this rank's rows of the orthogonalized update, with the LR adjusted to
        the whole matrix's shape."""
        old = local(p)
        param = _candidate(old, taken)
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        rows = param.shape[-2]
        if rows:  # a rank may hold no rows of a small matrix
            param[..., :rows, :].add_(ortho[..., :rows, :],
                                      alpha=-adjusted_lr(lr, p.shape[-2], p.shape[-1],
                                                         group["lr_adjust"]))
        _commit(old, param, taken)

    def _adamw_step(self, group: dict, taken: torch.Tensor | None) -> None:
        """torch.optim.AdamW's single-tensor update, on local shards, with the step counter and the
        bias corrections on the device. They are float64 there and take the operations Python does
        on host numbers (pow, including the ** 0.5 that torch would turn into sqrt, which rounds
        differently), and are used as 0-dim tensors where torch's update uses numbers; on the CPU
        that rounds the same."""
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            old, grad = local(p), local(p.grad)
            exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
            _commit(state["step"], _candidate(state["step"], taken).add_(1), taken)
            # on a skipped step what follows is computed from the old state and then discarded
            step = state["step"].double()
            param = _candidate(old, taken).mul_(1 - lr * group["weight_decay"])
            _commit(exp_avg, _candidate(exp_avg, taken).lerp_(grad, 1 - beta1), taken)
            _commit(exp_avg_sq,
                    _candidate(exp_avg_sq, taken).mul_(beta2).addcmul_(grad, grad, value=1 - beta2),
                    taken)
            bias_correction1 = 1 - torch.pow(beta1, step)
            bias_correction2 = 1 - torch.pow(beta2, step)
            half = torch.full((), 0.5, dtype=torch.float64, device=step.device)
            denom = (exp_avg_sq.sqrt() / bias_correction2.pow(half)).add_(eps)
            step_size = torch.full((), -lr, dtype=torch.float64, device=step.device).div_(
                bias_correction1)
            # addcdiv's order: param + (step_size * exp_avg) / denom
            param.add_(exp_avg.mul(step_size).div_(denom))
            _commit(old, param, taken)


def _candidate(t: torch.Tensor, taken: torch.Tensor | None) -> torch.Tensor:
    """Where a step's new value of `t` is computed in place: `t` itself, or a copy when the step may
    be skipped (then _commit chooses)."""
    return t if taken is None else t.clone()


def _commit(t: torch.Tensor, new: torch.Tensor, taken: torch.Tensor | None) -> None:
    """t <- new where the step is taken; t keeps its value where it is not (nothing to do without a
    flag: `new` is `t`)."""
    if taken is not None:
        torch.where(taken, new, t, out=t)


def _orthogonalize(update: torch.Tensor, group: dict) -> torch.Tensor:
    """Newton-Schulz of a whole matrix or expert stack."""
    return newton_schulz(update, group["ns_steps"], group["ns_coefficients"],
                         getattr(torch, group["ns_dtype"]), group["ns_eps"])


_CHECKS = {  # key: (holds, problem, fix)
    "weight_decay": (lambda v: v >= 0, "is negative.", "use 0 or more."),
    "betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "is not two numbers in [0, 1).",
              "use [0.9, 0.95]."),
    "eps": (lambda v: v > 0, "is not positive.", "use 1e-8."),
    "momentum": (lambda v: 0 <= v < 1, "is outside [0, 1).", "use 0.95."),
    "ns_steps": (lambda v: isinstance(v, int) and v >= 1, "is not a positive integer.", "use 5."),
    "ns_eps": (lambda v: v > 0, "is not positive.", "use 1e-7."),
    **{key: (lambda v, allowed=allowed: v in allowed, "is not a known value.",
             f"use one of: {', '.join(allowed)}.")
       for key, allowed in (("ns_coefficients", NS_COEFFICIENTS), ("ns_dtype", NS_DTYPES),
                            ("lr_adjust", LR_ADJUSTS))},
}
ADAMW_KEYS = ("weight_decay", "betas", "eps")
MUON_KEYS = ("weight_decay", "momentum", "ns_steps", "ns_eps", "ns_coefficients", "ns_dtype",
             "lr_adjust")


def check_options(options: dict, keys: tuple[str, ...], name) -> None:
    """The checks OptimConfig and Muon's parameter groups share, of options[key] for each of `keys`;
    an error names the option as name(key)."""
    for key in keys:
        holds, problem, fix = _CHECKS[key]
        if not holds(options[key]):
            raise ScalevecError(name(key), f"{options[key]!r} {problem}", fix)


def _validate_group(group: dict, where: str) -> None:
    """Reject bad hyperparameters and parameters that Muon cannot handle, naming the key and the
    fix."""
    if not group["lr"] >= 0:
        raise ScalevecError(f"{where}: lr", f"{group['lr']} is negative.",
                            "use a learning rate >= 0.")
    check_options(group, MUON_KEYS if group["use_muon"] else ADAMW_KEYS,
                  lambda key: f"{where}: {key}")
    if not group["use_muon"]:
        return
    for p in group["params"]:
        if p.ndim not in (2, 3):
            raise ScalevecError(where, f"a parameter of shape {tuple(p.shape)} is in a Muon group; "
                                "Muon takes matrices and [experts, rows, cols] stacks.",
                                "route it to an AdamW group (use_muon=False).")

"""Optimizer parameter groups and the optimizer itself.

Every parameter gets exactly one kind, decided by its name (never by its shape): a scale-site
parameter the group the model's plan gives it (model/plan.py: its decay rule under the strategy's
policy); the token embedding and the output head decay by the optimizer config; every other
parameter is a hidden matrix. Under model.parameterization=mup each kind's LR, decoupled weight
decay and Adam eps are multiplied as `rates` says (docs/concepts/parameterization.md).
"""

from dataclasses import dataclass

import torch
from torch import nn

from scalevec_train.model.parameterization import Kind, Parameterization
from scalevec_train.model.plan import GROUPS, Decay
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.adamw import AdamW, FusedAdamW
from scalevec_train.optim.config import OptimConfig
from scalevec_train.optim.muon import Muon

# The scale sites' groups (the plan's): scale_decay: p <- p (1 - lr wd), the optimizer's own decay;
# scale_log_decay: an `er` site's b <- b + log(1 - lr wd) (adamw.log_decay, which the optimizers
# apply); scale_no_decay: no decay.
KINDS = ("matrix", "embedding", "head", GROUPS[Decay.SCALE], GROUPS[Decay.LOG], GROUPS[Decay.NONE])


def classify(model: Transformer) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the parameters into KINDS; raise if any parameter would land in none or two."""
    site_kind = {name: p.group for name, p in model.plan.site_parameters().items()}
    kinds: dict[str, list[tuple[str, nn.Parameter]]] = {k: [] for k in KINDS}
    for name, p in model.named_parameters():
        if name in site_kind:
            kind = site_kind[name]
        elif name == "tok_emb.weight":
            kind = "embedding"
        elif name == "head.weight":
            kind = "head"
        else:
            kind = "matrix"
        kinds[kind].append((name, p))
    grouped = [id(p) for members in kinds.values() for _, p in members]
    if (len(grouped) != len(set(grouped)) or set(grouped) != {id(p) for p in model.parameters()}
            or sum(len(kinds[g]) for g in GROUPS.values()) != len(site_kind)):
        raise RuntimeError("optimizer groups do not cover every parameter exactly once, as the "
                           "scale plan lists them")
    return kinds


@dataclass(frozen=True)
class Rates:
    """What multiplies a parameter's peak LR, its decoupled weight decay and its Adam eps."""

    lr: float = 1.0
    weight_decay: float = 1.0
    eps: float = 1.0


def rates(p: Parameterization, kind: Kind, cfg: OptimConfig, muon: bool) -> Rates:
    """The multipliers of a parameter of `kind` under the model's parameterization (all 1 under sp);
    `muon`: updated by Muon. m_N, m_L: the width and depth multipliers. AdamW: muP's Adam rule
    (hidden matrices' LR 1 / m_N, every other kind's 1) and CompleteP's at alpha = 1 (no LR change
    with depth; eps 1 / m_N for the embedding and readouts, 1 / (m_N m_L) for what lies inside the
    blocks); the weight decay keeps lr * wd where it was. Muon: the spectral condition (Yang,
    Simon & Bernstein 2023, ||dW|| ~ sqrt(fan_out / fan_in)) for an update whose singular values are
    all 1 times lr_adjust's factor: `original`'s, sqrt(max(1, rows / cols)), meets it at one LR for
    every width; match_rms_adamw's, 0.2 sqrt(max(rows, cols)), grows as sqrt(m_N), so the LR follows
    1 / sqrt(m_N)."""
    if p.name == "sp":
        return Rates()
    n, depth = p.width, p.depth
    if muon:
        lr = 1.0 if cfg.lr_adjust == "original" else n**-0.5
        return Rates(lr, 1 / lr)
    if kind is Kind.HIDDEN:
        return Rates(1 / n, n, 1 / (n * depth))
    if kind is Kind.VECTOR:
        return Rates(eps=1 / (n * depth))
    return Rates(eps=1 / n)


# the muP kind of each optimizer group's parameters
_KIND = {"matrix": Kind.HIDDEN, "embedding": Kind.EMBEDDING, "head": Kind.READOUT,
         "router": Kind.READOUT, **{g: Kind.VECTOR for g in GROUPS.values()}}


def param_groups(model: Transformer, cfg: OptimConfig) -> list[dict]:
    """One group per kind. Each group keeps its peak LR in `base_lr`: the schedule multiplies it.
    Under Muon, hidden matrices (and the MoE router only with muon_router) are Muon groups; every
    other kind is an AdamW group. Scale-site kinds take optim.scale_lr and optim.scale_weight_decay
    (null: what the other groups take). Under mup the router is a group of its own (a readout), and
    every group's LR, decay and eps are multiplied by its `rates`."""
    decay = {
        "matrix": cfg.weight_decay,
        "embedding": cfg.weight_decay if cfg.decay_embeddings else 0.0,
        "head": cfg.weight_decay if cfg.decay_head else 0.0,
        "scale_decay": cfg.scale_decay(),
        "scale_log_decay": 0.0,  # the optimizer must not decay b toward 0: log_decay shifts it
        "scale_no_decay": 0.0,
    }
    kinds = classify(model)
    mup = model.parameterization
    if (cfg.name == "muon" and not cfg.muon_router) or mup.name == "mup":
        # The router is a matrix, but a tiny, fast-moving one: AdamW unless asked for; under mup a
        # readout, with a readout's rates.
        kinds["router"] = [(n, p) for n, p in kinds["matrix"] if n.endswith("router.weight")]
        kinds["matrix"] = [(n, p) for n, p in kinds["matrix"] if not n.endswith("router.weight")]
        decay["router"] = cfg.weight_decay
    groups = []
    for kind, members in kinds.items():
        if not members:
            continue
        if kind.startswith("scale_"):
            peak = cfg.scale_peak_lr()
        else:
            peak = cfg.lr if kind == "matrix" else cfg.adamw_peak_lr()
        use_muon = cfg.name == "muon" and kind == "matrix"
        r = rates(mup, _KIND[kind], cfg, use_muon)
        group = {"name": kind, "params": [p for _, p in members],
                 "weight_decay": decay[kind] * r.weight_decay, "base_lr": peak * r.lr}
        if r.eps != 1:
            group["eps"] = cfg.eps * r.eps
        if kind == "scale_log_decay":
            group["log_weight_decay"] = cfg.scale_decay() * r.weight_decay
        if cfg.name == "muon":
            group["use_muon"] = use_muon
        groups.append(group)
    return groups


def build_optimizer(model: Transformer, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg)
    if cfg.name == "muon":
        optimizer = Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                         nesterov=cfg.nesterov, ns_steps=cfg.ns_steps,
                         ns_coefficients=cfg.ns_coefficients, ns_dtype=cfg.ns_dtype,
                         lr_adjust=cfg.lr_adjust, ns_eps=cfg.ns_eps, betas=tuple(cfg.betas),
                         eps=cfg.eps)
    else:
        adamw = FusedAdamW if next(model.parameters()).is_cuda else AdamW
        optimizer = adamw(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return optimizer


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """One line per group: its name, size and decay, printed at start-up."""
    rows = []
    for g in optimizer.param_groups:
        count = sum(p.numel() for p in g["params"])
        how = ("muon" if g["use_muon"] else "adamw") if "use_muon" in g else ""
        wd = g.get("log_weight_decay", g["weight_decay"])
        rows.append(f"{g['name']}: {len(g['params'])} tensors, {count:,} params, "
                    f"lr={g['base_lr']:g}, wd={wd}"
                    + (f", {how}" if how else ""))
    return "; ".join(rows)

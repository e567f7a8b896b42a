"""Optimizer parameter groups and the optimizer itself.

Every parameter gets exactly one kind, decided by its name and its scale site (never by its shape):
scale-site parameters decay by the strategy's policy; the token embedding and the output head decay by
the optimizer config; every other parameter is a hidden matrix.
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from scalevec_train.errors import ScalevecError
from scalevec_train.strategies import ScaleConfig, scale_sites

KINDS = ("matrix", "embedding", "head", "scale_decay", "scale_no_decay")


@dataclass
class OptimConfig:
    # adamw
    name: str = "adamw"
    # peak learning rate (the schedule multiplies it)
    lr: float = 3e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # decoupled weight decay for hidden matrices (and whatever the options below include)
    weight_decay: float = 0.1
    # decay the token embedding (and a tied head) too
    decay_embeddings: bool = False
    # decay an untied output head too
    decay_head: bool = True

    def validate(self) -> None:
        if self.name != "adamw":
            raise ScalevecError("optim.name", f"unknown optimizer {self.name!r}.", "use optim=adamw.")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ScalevecError("optim.lr" if self.lr <= 0 else "optim.weight_decay",
                                "lr must be positive and weight_decay non-negative.")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ScalevecError("optim.betas", f"{self.betas} is not two numbers in [0, 1).")


def classify(model: nn.Module, scale: ScaleConfig) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split the parameters into KINDS; raise if any parameter would land in none or two."""
    site_role = {id(p): site.role for _, site in scale_sites(model) for p in site.parameters()}
    kinds: dict[str, list[tuple[str, nn.Parameter]]] = {k: [] for k in KINDS}
    for name, p in model.named_parameters():
        if id(p) in site_role:
            kind = "scale_decay" if scale.decays(site_role[id(p)]) else "scale_no_decay"
        elif name == "tok_emb.weight":
            kind = "embedding"
        elif name == "head.weight":
            kind = "head"
        else:
            kind = "matrix"
        kinds[kind].append((name, p))
    grouped = [id(p) for members in kinds.values() for _, p in members]
    if len(grouped) != len(set(grouped)) or set(grouped) != {id(p) for p in model.parameters()}:
        raise RuntimeError("optimizer groups do not cover every parameter exactly once")
    return kinds


def param_groups(model: nn.Module, cfg: OptimConfig, scale: ScaleConfig) -> list[dict]:
    decay = {
        "matrix": cfg.weight_decay,
        "embedding": cfg.weight_decay if cfg.decay_embeddings else 0.0,
        "head": cfg.weight_decay if cfg.decay_head else 0.0,
        "scale_decay": cfg.weight_decay,
        "scale_no_decay": 0.0,
    }
    return [
        {"name": kind, "params": [p for _, p in members],
         "weight_decay": decay[kind]}
        for kind, members in classify(model, scale).items() if members
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig, scale: ScaleConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg, scale)
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=on_cuda)


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """One line per group: its name, size and decay, printed at start-up."""
    rows = []
    for g in optimizer.param_groups:
        count = sum(p.numel() for p in g["params"])
        rows.append(f"{g['name']}: {len(g['params'])} tensors, {count:,} params, wd={g['weight_decay']}")
    return "; ".join(rows)

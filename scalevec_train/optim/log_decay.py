"""Weight decay of an `er` site's magnitude: b <- b + log(1 - lr wd) before each step, for the groups with
a `log_weight_decay`, which shrinks s = exp(b) alpha / rms(alpha) by the decoupled factor (1 - lr wd), as
the optimizer's own decay shrinks a plain site (docs/scale-vectors.md, "Weight decay on scale sites").
The optimizers apply it themselves (adamw.py, muon.py), first in their step."""

import math

import torch

from scalevec_train.dtensor import local


@torch.no_grad()
def log_decay(param_groups: list[dict], taken: torch.Tensor | None = None) -> None:
    """Shift every parameter of the groups with a `log_weight_decay` by log(1 - lr wd); where the 0-dim
    bool `taken` is given, only if it is true (on the device: a step skipped changes nothing)."""
    for group in param_groups:
        wd = group.get("log_weight_decay", 0.0)
        if wd and group["lr"]:
            shift = math.log(1.0 - group["lr"] * wd)  # OptimConfig.validate keeps lr * wd below 1
            for p in group["params"]:
                if taken is None:
                    p.add_(shift)
                else:
                    t = local(p)
                    torch.where(taken, t + shift, t, out=t)

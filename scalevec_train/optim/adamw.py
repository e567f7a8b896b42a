"""torch's AdamW with what scalevec's groups add to a step: the `er` sites' log decay
(log_decay below), before the update as torch's own decay; and, fused (CUDA), a step skipped on the
device (StepsWhere)."""

import math
from typing import Protocol, runtime_checkable

import torch

from scalevec_train.parallel.process_group import local


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, unfused unless asked (the CPU's for-loop AdamW), each step preceded by the
    log decay of the groups that have a `log_weight_decay`."""

    def __init__(self, params, fused: bool = False, **kwargs):
        super().__init__(params, fused=fused, **kwargs)

    def step(self, closure=None):
        log_decay(self.param_groups)
        return super().step(closure)


class FusedAdamW(AdamW):
    """torch's fused AdamW, which can skip a step on the device (optim/adamw.py, StepsWhere)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)

    def step_where(self, taken: torch.Tensor) -> None:
        log_decay(self.param_groups, taken)
        # torch's fused kernels skip the update, and undo their step-counter increment, where the
        # optimizer's `found_inf` is nonzero: torch.amp.GradScaler's convention, torch's only way in
        self.found_inf = (~taken).float()
        try:
            # torch's step, without the unconditional log decay of AdamW.step
            super(AdamW, self).step()
        finally:
            del self.found_inf


@runtime_checkable
class StepsWhere(Protocol):
    def step_where(self, taken: torch.Tensor) -> None:
        """The optimizer's step where the 0-dim bool tensor `taken` (on the parameters' device) is
        true, bit for bit as step(); where it is false, parameters and optimizer state (step
        counters included) stay exactly as they were. Reads nothing on the host."""


@torch.no_grad()
def log_decay(param_groups: list[dict], taken: torch.Tensor | None = None) -> None:
    """Shift every parameter of the groups with a `log_weight_decay` by log(1 - lr wd); where the
    0-dim bool `taken` is given, only if it is true (on the device: a step skipped changes
    nothing)."""
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

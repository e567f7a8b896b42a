"""torch's AdamW with what scalevec's groups add to a step: the `er` sites' log decay (log_decay.py),
before the update as torch's own decay; and, fused (CUDA), a step skipped on the device (StepsWhere)."""

import torch

from scalevec_train.optim.log_decay import log_decay


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW, unfused unless asked (the CPU's for-loop AdamW), each step preceded by the log
    decay of the groups that have a `log_weight_decay`."""

    def __init__(self, params, fused: bool = False, **kwargs):
        super().__init__(params, fused=fused, **kwargs)

    def step(self, closure=None):
        log_decay(self.param_groups)
        return super().step(closure)


class FusedAdamW(AdamW):
    """torch's fused AdamW, which can skip a step on the device (optim/protocol.py, StepsWhere)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)

    def step_where(self, taken: torch.Tensor) -> None:
        log_decay(self.param_groups, taken)
        # torch's fused kernels skip the update, and undo their step-counter increment, where the
        # optimizer's `found_inf` is nonzero: torch.amp.GradScaler's convention, torch's only way in
        self.found_inf = (~taken).float()
        try:
            super(AdamW, self).step()  # torch's step, without the unconditional log decay of AdamW.step
        finally:
            del self.found_inf

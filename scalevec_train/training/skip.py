"""An optimizer step that happens only where a flag on the device says so, without the host ever reading
the flag: the trainer decides whether a step is finite on the device and must not wait for the answer.

A taken step is the optimizer's own step, operation for operation (the same numbers as an unconditional
step); a step that is not taken leaves parameters, optimizer state (step counters, moments, momentum) and
the model's buffers (MoE expert biases, which an optimizer post-hook updates) exactly as they were.

Two ways, chosen by the optimizer:
  - optimizers that take the flag themselves, as `found_inf` (a float tensor, nonzero: skip), as under
    torch.amp.GradScaler: torch's fused optimizers (AdamW on CUDA; the kernel skips its update and undoes
    its step-counter increment) and those that say `reads_found_inf = True` (Muon). Their step hooks
    must honour the flag too (the `er` sites' log decay, the MoE expert-bias update do, and say so with
    the same attribute); nothing is copied;
  - every other optimizer (the for-loop AdamW torch runs on CPU), or one with a hook that does not
    read the flag, steps as usual, and every tensor the step may change is then chosen, element for
    element, between its value before and after (torch.where). This keeps a copy of parameters,
    optimizer state and the model's buffers.
"""

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage), or the tensor itself: selection stays on this rank."""
    return t.to_local() if hasattr(t, "to_local") else t


def takes_flag(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` and its step hooks skip a step themselves where `found_inf` says so."""
    native = getattr(optimizer, "reads_found_inf", False) or all(g.get("fused") for g in optimizer.param_groups)
    hooks = [*optimizer._optimizer_step_pre_hooks.values(), *optimizer._optimizer_step_post_hooks.values()]
    return native and all(getattr(hook, "reads_found_inf", False) for hook in hooks)


class ConditionalStep:
    """Steps `optimizer` where a flag says. Where the optimizer does not take the flag, the copies of what
    a step may change are kept between steps (allocated once: a fresh copy every step costs more than the
    copying)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module):
        self.optimizer, self.model = optimizer, model
        self.copies: dict[int, torch.Tensor] = {}

    def _keep(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(t's local tensor, its copy as it is now); copies are found by the tensor t, which lives on
        from step to step (a DTensor's local view is a new object every time)."""
        local = _local(t)
        copy = self.copies.get(id(t))
        if copy is None or copy.shape != local.shape:
            copy = self.copies[id(t)] = torch.empty_like(local)
        return local, copy.copy_(local)

    @torch.no_grad()
    def __call__(self, taken: torch.Tensor) -> None:
        """optimizer.step() where the 0-dim bool tensor `taken` is true; nothing changes where it is
        false. Every rank must pass the same verdict (the step may hold collectives)."""
        optimizer = self.optimizer
        if takes_flag(optimizer):
            optimizer.found_inf = (~taken).float()
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
            return
        kept = [self._keep(b) for b in self.model.buffers()]
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        kept += [self._keep(p) for p in params]
        had = {p: {k for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)} for p in params}
        kept += [self._keep(optimizer.state[p][k]) for p in params for k in had[p]]
        optimizer.step()
        for p in params:
            for key, now in optimizer.state[p].items():
                if isinstance(now, torch.Tensor) and key not in had[p]:
                    # created by this step: its value before is the optimizer's initial zeros
                    kept.append((_local(now), torch.zeros_like(_local(now))))
        for now, before in kept:
            torch.where(taken.to(now.device), now, before, out=now)

"""An optimizer step that happens only where a flag on the device says so, without the host ever reading
the flag: the trainer decides whether a step is finite on the device and must not wait for the answer.

A taken step is the optimizer's own step, operation for operation (the same numbers as an unconditional
step); a step that is not taken leaves parameters, optimizer state (step counters, moments, momentum) and
the model's buffers (MoE expert biases, which an optimizer post-hook updates) exactly as they were.

Two ways, chosen by the optimizer:
  - torch's fused optimizers (AdamW on CUDA) take the flag themselves: `found_inf`, as under
    torch.amp.GradScaler, skips the kernel's update and undoes its step-counter increment;
  - every other optimizer (the for-loop AdamW torch runs on CPU, Muon) steps as usual, and every tensor
    the step may change is then chosen, element for element, between its value before and after
    (torch.where). This keeps one copy of what the step changes for the length of the step.
"""

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage), or the tensor itself: selection stays on this rank."""
    return t.to_local() if hasattr(t, "to_local") else t


def _takes_flag(optimizer: torch.optim.Optimizer) -> bool:
    # A step pre-hook (the `er` sites' log decay) changes parameters outside the fused kernel.
    fused = all(g.get("fused") for g in optimizer.param_groups)
    return fused and not optimizer._optimizer_step_pre_hooks


@torch.no_grad()
def step_where(optimizer: torch.optim.Optimizer, model: nn.Module, taken: torch.Tensor) -> None:
    """optimizer.step() where the 0-dim bool tensor `taken` is true; nothing changes where it is false.
    Every rank must pass the same verdict (the step may hold collectives)."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    if _takes_flag(optimizer):
        optimizer.found_inf = (~taken).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        before = {p: (_local(p).clone(), {k: _local(v).clone() for k, v in optimizer.state[p].items()
                                          if isinstance(v, torch.Tensor)}) for p in params}
        optimizer.step()
        for p, (value, state) in before.items():
            _select(taken, _local(p), value)
            for key, now in optimizer.state[p].items():
                if isinstance(now, torch.Tensor):
                    # state created by this step: its value before is the optimizer's initial zeros
                    old = state.get(key)
                    _select(taken, _local(now), old if old is not None else torch.zeros_like(_local(now)))
    for b, old in buffers:
        _select(taken, b, old)


def _select(taken: torch.Tensor, now: torch.Tensor, before: torch.Tensor) -> None:
    now.copy_(torch.where(taken.to(now.device), now, before))

"""An optimizer step that happens only where a flag on the device says so, without the host ever
reading the flag: the trainer decides whether a step is finite on the device and must not wait for
the answer.

A taken step is the optimizer's own step, operation for operation (the same numbers as an
unconditional step), followed by the model's update after a step (model.update_after_step: the MoE
expert biases); a step that is not taken leaves parameters, optimizer state (step counters, moments,
momentum) and the model's buffers exactly as they were.

Two ways, chosen by the optimizer:
  - an optimizer that takes the verdict itself (optim/adamw.py, StepsWhere: Muon, the fused AdamW)
    steps with it, and the model's update takes it too; nothing is copied;
  - every other optimizer (the for-loop AdamW torch runs on CPU) steps as usual, and every tensor
    the step and the model's update may change is then chosen, element for element, between its
    value before and after (torch.where). This keeps a copy of parameters, optimizer state and the
    model's buffers.
"""

import torch

from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.adamw import StepsWhere
from scalevec_train.parallel.process_group import local


class ConditionalStep:
    """Steps `optimizer` where a flag says. Where the optimizer does not take the flag, the copies
    of what a step may change are kept between steps (allocated once: a fresh copy every step costs
    more than the copying)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: Transformer):
        self.optimizer, self.model = optimizer, model
        self.copies: dict[int, torch.Tensor] = {}

    def _keep(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(t's local tensor, its copy as it is now); copies are found by the tensor t, which lives
        on from step to step."""
        here = local(t)
        copy = self.copies.get(id(t))
        if copy is None or copy.shape != here.shape:
            copy = self.copies[id(t)] = torch.empty_like(here)
        return here, copy.copy_(here)

    @torch.no_grad()
    def __call__(self, taken: torch.Tensor) -> None:
        """optimizer.step() and model.update_after_step() where the 0-dim bool tensor `taken` is
        true; nothing changes where it is false. Every rank must pass the same verdict (the step and
        the update may hold collectives)."""
        optimizer = self.optimizer
        if isinstance(optimizer, StepsWhere):
            optimizer.step_where(taken)
            self.model.update_after_step(taken)
            return
        kept = [self._keep(b) for b in self.model.buffers()]
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        kept += [self._keep(p) for p in params]
        had = {p: {k for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
               for p in params}
        kept += [self._keep(optimizer.state[p][k]) for p in params for k in had[p]]
        optimizer.step()
        self.model.update_after_step()
        for p in params:
            for key, now in optimizer.state[p].items():
                if isinstance(now, torch.Tensor) and key not in had[p]:
                    # created by this step: its value before is the optimizer's initial zeros
                    kept.append((local(now), torch.zeros_like(local(now))))
        for now, before in kept:
            torch.where(taken.to(now.device), now, before, out=now)

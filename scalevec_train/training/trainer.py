"""The training loop: it takes optimizer steps and calls its callbacks' hooks; everything that observes
the run (throughput, scale statistics, evaluation, checkpoints, the numerical guard, SIGTERM) is a
callback (callbacks/).

One step: for each micro-batch, forward (plus the model's auxiliary loss), backward; gradients synced
and clipped; the optimizer steps unless the loss or gradient norm is not finite. A step that is not
taken changes nothing (its gradients are dropped, the model forgets its step state), but its batches
count as used and the step counter (and with it the learning-rate schedule) advances. Every rank
reaches the same verdict: the loss is averaged over the ranks and the gradient norm is global.

The model is a module mapping tokens to logits that also offers auxiliary_loss() (a tensor to add to
the loss, or None) and discard_step_state(), as model.Transformer does.
"""

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_train.parallel.fsdp import clip_grad_norm, reduce_replicated_grads, replicated_params, set_gradient_sync
from scalevec_train.parallel.process_group import all_reduce_mean
from scalevec_train.training.guards import StepGuard
from scalevec_train.training.logger import MetricsLogger


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def training_loss(compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """cross_entropy, or compiled as one graph (distributed.compile): fused, the fp32 logits, softmax and
    its gradient take fewer passes (about 2x faster on a CPU at dense-study's shape, docs/benchmarks.md)."""
    return torch.compile(cross_entropy, fullgraph=True) if compiled else cross_entropy


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over the step's micro-batches and the ranks
    grad_norm: float  # global, before clipping
    taken: bool  # False: not finite, so nothing changed
    seconds: float  # wall time of the step


class Callback:
    """Observes the loop. Every hook does nothing unless a subclass overrides it; hooks run in the
    order of the trainer's callback list."""

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Before the first step (also of a resumed run)."""

    def on_step_start(self, trainer: "Trainer") -> None:
        """Before a step's first forward."""

    def on_backward_end(self, trainer: "Trainer") -> None:
        """The step's gradients are complete (synced over ranks, not yet clipped)."""

    def on_step_end(self, trainer: "Trainer", result: StepResult) -> dict:
        """After the step; returns metrics this step must log (or {}). May call trainer.request_log()
        or trainer.request_stop()."""
        return {}

    def on_log(self, trainer: "Trainer", record: dict) -> None:
        """A logged step's record (step, loss, lr, grad_norm, tokens): add metrics to it."""

    def on_step_done(self, trainer: "Trainer") -> None:
        """After the step's record is written."""

    def on_fit_end(self, trainer: "Trainer") -> None:
        """After the last step, or the step a stop was requested at; not after an exception."""

    def on_close(self, trainer: "Trainer") -> None:
        """Always, last: release what on_fit_start took."""


class Trainer:
    """Trains `model` from step `start_step` to `steps` (or an earlier requested stop).

    lr_at(step) is the schedule's multiplier of each group's `base_lr`; `autocast` returns the precision
    context of a forward. Fault injection for tests: nan_steps are steps whose loss is made NaN,
    inf_grad_steps steps whose loss stays finite while the gradient it starts the backward with is infinite."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader, lr_at: Callable[[int], float],
                 steps: int, accum: int, grad_clip: float, device: torch.device,
                 autocast: Callable[[], AbstractContextManager], log_every: int, tokens_per_step: int,
                 callbacks: list[Callback], start_step: int = 0, nan_steps: frozenset[int] = frozenset(),
                 inf_grad_steps: frozenset[int] = frozenset(), compile_loss: bool = False):
        self.model, self.optimizer, self.loader, self.lr_at = model, optimizer, loader, lr_at
        self.steps, self.accum, self.grad_clip, self.device = steps, accum, grad_clip, device
        self.autocast, self.log_every, self.tokens_per_step = autocast, log_every, tokens_per_step
        self.callbacks, self.step, self.nan_steps = callbacks, start_step, nan_steps
        self.inf_grad_steps = inf_grad_steps
        self.loss_fn = training_loss(compile_loss)
        self.logger: MetricsLogger | None = None  # set by fit()
        self.replicated = replicated_params(model)
        self.stop_reason: str | None = None
        self._log_requested = False

    def is_log_step(self, step: int) -> bool:
        """Whether step number `step` (1-based: the step in progress is self.step + 1) logs regularly."""
        return step % self.log_every == 0 or step == self.steps

    @property
    def tokens(self) -> int:
        return self.step * self.tokens_per_step

    def request_log(self) -> None:
        self._log_requested = True

    def request_stop(self, reason: str) -> None:
        self.stop_reason = self.stop_reason or reason

    def _hooks(self, name: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, name)(self, *args)

    def train_step(self) -> StepResult:
        """One optimizer step over the global batch."""
        start = time.perf_counter()
        multiplier = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * multiplier
        total = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in self.loader.next_batch())
            set_gradient_sync(self.model, micro == self.accum - 1)
            with self.autocast():
                loss = self.loss_fn(self.model(inputs), targets)
            if self.step + 1 in self.nan_steps:
                loss = loss * float("nan")
            total += loss.detach()
            aux = self.model.auxiliary_loss()
            if aux is not None:  # trains the router; not part of the logged loss
                loss = loss + aux
            if self.step + 1 in self.inf_grad_steps:
                loss.register_hook(lambda grad: grad * float("inf"))
            (loss / self.accum).backward()
        reduce_replicated_grads(self.replicated)
        self._hooks("on_backward_end")
        grad_norm = clip_grad_norm(self.model, self.grad_clip if self.grad_clip > 0 else float("inf"))
        mean_loss = all_reduce_mean(total / self.accum).item()
        taken = StepGuard.finite(mean_loss, grad_norm)
        if taken:
            self.optimizer.step()
        else:
            self.model.discard_step_state()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(mean_loss, grad_norm, taken, time.perf_counter() - start)

    def fit(self, logger: MetricsLogger) -> str | None:
        """Train to `steps`, writing records to `logger`; returns the reason of an early stop (None when
        the run is complete)."""
        self.logger = logger
        try:
            self._hooks("on_fit_start")
            while self.step < self.steps and self.stop_reason is None:
                self._one_step()
            self._hooks("on_fit_end")
        finally:
            self._hooks("on_close")
        return self.stop_reason

    def _one_step(self) -> None:
        self._log_requested = False
        self._hooks("on_step_start")
        result = self.train_step()
        self.step += 1
        extra: dict = {}
        for cb in self.callbacks:
            extra.update(cb.on_step_end(self, result))
        self.logger.advance()
        record: dict = {}
        if self.is_log_step(self.step) or self._log_requested or self.stop_reason:
            record = {"step": self.step, "lr": self.optimizer.param_groups[0]["lr"], "tokens": self.tokens}
            if result.taken:  # NaN and Infinity are not JSON
                record.update(loss=result.loss, grad_norm=result.grad_norm)
            self._hooks("on_log", record)
        if extra:
            record.update({"step": self.step, "tokens": self.tokens, **extra})
        if self.stop_reason:
            record["stopped"] = self.stop_reason
        if record:
            self.logger.log(record)
        self._hooks("on_step_done")

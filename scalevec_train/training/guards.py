"""What keeps a run alive through bad numbers and pre-emption (docs/guides/reliability.md): the bookkeeping of
the non-finite-step guard and the loss-spike log, the SIGTERM stop request, and the fault injection
(a wrapper around the training loss) the tests use to exercise them."""

import math
import os
import signal
import threading
from collections.abc import Callable

import torch

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.training.trainer import Callback, Trainer

# Fault injection for testing the numerical guards (docs/guides/reliability.md), unset in real runs: steps
# whose loss is made NaN (SCALEVEC_FAULT_NAN_STEPS=3,4), and steps whose loss stays finite while its
# gradient is made infinite (SCALEVEC_FAULT_INF_GRAD_STEPS=5). A step applies to every rank, step@rank
# (3@1) to that rank only.
FAULT_NAN_ENV = "SCALEVEC_FAULT_NAN_STEPS"
FAULT_INF_GRAD_ENV = "SCALEVEC_FAULT_INF_GRAD_STEPS"


def fault_steps(env: str, rank: int) -> frozenset[int]:
    """The steps that fault-injection variable `env` names for `rank`."""
    raw = os.environ.get(env, "")
    steps = set()
    try:
        for entry in filter(None, (s.strip() for s in raw.split(","))):
            step, _, only = entry.partition("@")
            if not only or int(only) == rank:
                steps.add(int(step))
    except ValueError:
        raise ScalevecError(env, f"{raw!r} is not a comma-separated list of step numbers (each optionally "
                            "@rank).", "unset it (it only injects faults for tests), or write e.g. 3,4 or 3@1."
                            ) from None
    return frozenset(steps)


class FaultInjection(Callback):
    """The training loss `loss_fn` with the faults of the environment's fault-injection variables for
    this rank: made NaN on nan_steps; finite, with an infinite gradient, on inf_grad_steps. A callback
    too: it follows the step in progress."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], nan_steps: frozenset[int],
                 inf_grad_steps: frozenset[int]):
        self.loss_fn, self.nan_steps, self.inf_grad_steps = loss_fn, nan_steps, inf_grad_steps
        self.step = 0

    @classmethod
    def from_env(cls, loss_fn, rank: int) -> "FaultInjection | None":
        """The wrapper the environment asks for, or None (real runs)."""
        nan_steps, inf_grad_steps = fault_steps(FAULT_NAN_ENV, rank), fault_steps(FAULT_INF_GRAD_ENV, rank)
        return cls(loss_fn, nan_steps, inf_grad_steps) if nan_steps or inf_grad_steps else None

    def on_step_start(self, trainer: Trainer) -> None:
        self.step = trainer.step + 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, targets)
        if self.step in self.nan_steps:
            loss = loss * float("nan")
        if self.step in self.inf_grad_steps:
            loss.register_hook(lambda grad: grad * float("inf"))
        return loss


class StepGuard:
    """Bookkeeping of the numerical guards: non-finite steps (the trainer skips them) and loss spikes."""

    EMA_DECAY = 0.9  # the running average loss spans about the last 10 finite steps

    def __init__(self, max_bad_steps: int, spike_factor: float):
        self.max_bad_steps, self.spike_factor = max_bad_steps, spike_factor
        self.skipped = 0  # non-finite steps in the whole run
        self.streak = 0  # consecutive non-finite steps, up to the latest one
        self.loss_ema: float | None = None  # running average of the finite losses

    @staticmethod
    def finite(loss: float, grad_norm: float) -> bool:
        return math.isfinite(loss) and math.isfinite(grad_norm)

    def observe(self, loss: float, grad_norm: float) -> dict:
        """Counts one step; returns what its metrics record must add (empty for an ordinary step)."""
        if not self.finite(loss, grad_norm):
            self.skipped += 1
            self.streak += 1
            # Strings: NaN and Infinity are not JSON.
            return {"bad_step": True, "bad_loss": repr(loss), "bad_grad_norm": repr(grad_norm)}
        self.streak = 0
        ema = self.loss_ema
        self.loss_ema = loss if ema is None else self.EMA_DECAY * ema + (1 - self.EMA_DECAY) * loss
        if self.spike_factor and ema is not None and loss > self.spike_factor * ema:
            return {"loss_spike": True, "loss_ema": ema}
        return {}

    @property
    def diverged(self) -> bool:
        return self.streak >= self.max_bad_steps

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped, "bad_streak": self.streak, "loss_ema": self.loss_ema}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.streak, self.loss_ema = state["skipped_steps"], state["bad_streak"], state["loss_ema"]


class StopSignal:
    """While active, SIGTERM (what schedulers send before pre-emption or at a time limit) sets `received`
    instead of ending the process, so that training can stop after the current step with a checkpoint.
    Signal handlers belong to the main thread: elsewhere this does nothing."""

    def __init__(self):
        self.received = False
        self._installed = False
        self._previous = None

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)

"""What keeps a run alive through bad numbers and pre-emption (docs/guides/reliability.md): the
bookkeeping of the non-finite-step guard and the loss-spike log, and the SIGTERM stop request. The
tests exercise them with the faults of infra/faults.py (step.loss: a NaN loss, an infinite
gradient)."""

import math
import signal
import threading


class StepGuard:
    """Bookkeeping of the numerical guards: non-finite steps (the trainer skips them) and loss
    spikes."""

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
        """Counts one step; returns what its metrics record must add (empty for an ordinary
        step)."""
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
        self.skipped, self.streak, self.loss_ema = (state["skipped_steps"], state["bad_streak"],
                                                    state["loss_ema"])


class StopSignal:
    """While active, SIGTERM (what schedulers send before pre-emption or at a time limit) sets
    `received` instead of ending the process, so that training can stop after the current step with
    a checkpoint. Signal handlers belong to the main thread: elsewhere this does nothing."""

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
            signal.signal(signal.SIGTERM,
                          signal.SIG_DFL if self._previous is None else self._previous)

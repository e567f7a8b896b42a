"""What keeps a run alive (docs/reliability.md): the non-finite-step guard with the loss-spike log, and
a clean stop with a checkpoint on SIGTERM."""

import sys

from scalevec_train.parallel.process_group import any_rank, is_main
from scalevec_train.training.guards import StepGuard, StopSignal
from scalevec_train.training.trainer import Callback, StepResult, Trainer


class StabilityGuard(Callback):
    """Counts skipped (non-finite) steps and flags loss spikes, logging and warning about each; asks
    the run to stop after `max_bad_steps` non-finite steps in a row. `guard` is the checkpointed state."""

    def __init__(self, max_bad_steps: int, spike_factor: float):
        self.guard = StepGuard(max_bad_steps, spike_factor)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> dict:
        verdict = self.guard.observe(result.loss, result.grad_norm)
        if verdict:
            trainer.request_log()
            if is_main():
                print(f"warning: {self._message(trainer, verdict, result)}", file=sys.stderr)
        if self.guard.diverged:
            trainer.request_stop("diverged")
        return verdict

    def on_log(self, trainer: Trainer, record: dict) -> None:
        record["skipped_steps"] = self.guard.skipped

    def _message(self, trainer: Trainer, verdict: dict, result: StepResult) -> str:
        if "bad_step" in verdict:
            return (f"step {trainer.step} skipped: loss {result.loss}, gradient norm {result.grad_norm} "
                    f"({self.guard.streak} in a row; the run stops at train.max_bad_steps="
                    f"{self.guard.max_bad_steps}).")
        return (f"loss spike at step {trainer.step}: {result.loss:.4g} is more than train.spike_factor="
                f"{self.guard.spike_factor} times the running average {verdict['loss_ema']:.4g}.")


class SigtermStop(Callback):
    """While the run fits, SIGTERM (what schedulers send before pre-emption or at a time limit) stops it
    after the current step, on every rank at the same step, with a checkpoint (Checkpointer)."""

    def __init__(self):
        self.signal = StopSignal()

    def on_fit_start(self, trainer: Trainer) -> None:
        self.signal.__enter__()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> dict:
        if any_rank(self.signal.received, trainer.device):
            trainer.request_stop("SIGTERM")
        return {}

    def on_close(self, trainer: Trainer) -> None:
        self.signal.__exit__(None, None, None)

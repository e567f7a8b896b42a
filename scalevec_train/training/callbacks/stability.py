"""What keeps a run alive (docs/guides/reliability.md): the non-finite-step guard with the
loss-spike log, and a clean stop with a checkpoint on SIGTERM. Both read the device only on steps
that read back."""

import sys

import torch

from scalevec_train.infra.errors import DivergedError
from scalevec_train.parallel.process_group import any_rank, is_main
from scalevec_train.training.guards import StepGuard, StopSignal
from scalevec_train.training.trainer import Callback, StepResult, Trainer


class StabilityGuard(Callback):
    """Counts skipped (non-finite) steps and flags loss spikes, logging and warning about each;
    stops the run with a DivergedError after `max_bad_steps` non-finite steps in a row. The trainer
    skips non-finite steps on the device; this guard reads their losses and gradient norms when a
    step reads back, and judges the steps since the last such step one by one, in order (a step's
    record is written then). So a run stops at the first step that reads back (a log step) at or
    after the streak; steps between that were finite were taken. Its state (StepGuard's) is
    checkpointed as `guard`."""

    checkpoint_key = "guard"

    def __init__(self, max_bad_steps: int, spike_factor: float):
        self.guard = StepGuard(max_bad_steps, spike_factor)
        self.unread: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, [loss, grad_norm])
        self.last_good = 0  # the last step taken
        # the first streak of max_bad_steps: (first, last)
        self.diverged_at: tuple[int, int] | None = None

    def state_dict(self) -> dict:
        if self.unread:
            raise RuntimeError("the guard's state is saved at a step that did not read back")
        return self.guard.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state)

    def on_fit_start(self, trainer: Trainer) -> None:
        self.last_good = trainer.step - self.guard.streak

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.unread.append((trainer.step, trainer.lr, torch.stack([result.loss, result.grad_norm])))
        if not trainer.reads_back:
            return
        unread, self.unread = self.unread, []
        values = torch.stack([v for _, _, v in unread]).tolist()
        for (step, lr, _), (loss, grad_norm) in zip(unread, values, strict=True):
            self._judge(trainer, step, lr, loss, grad_norm)
        if self.diverged_at is not None:
            self._stop(trainer)

    def _judge(self, trainer: Trainer, step: int, lr: float, loss: float, grad_norm: float) -> None:
        verdict = self.guard.observe(loss, grad_norm)
        if StepGuard.finite(loss, grad_norm):
            self.last_good = step
        if verdict:
            if step == trainer.step:
                trainer.request_log()
            else:  # an earlier step: its record has what the trainer would have logged
                trainer.record("lr", lr, step)
                trainer.record("skipped_steps", self.guard.skipped, step)
                if "bad_step" not in verdict:
                    trainer.record("loss", loss, step)
                    trainer.record("grad_norm", grad_norm, step)
            for key, value in verdict.items():
                trainer.record(key, value, step)
            if is_main():
                print(f"warning: {self._message(step, verdict, loss, grad_norm)}", file=sys.stderr)
        if self.guard.diverged and self.diverged_at is None:
            self.diverged_at = (step - self.guard.streak + 1, step)

    def _stop(self, trainer: Trainer) -> None:
        """Stop at this step: the steps since the last read-back are judged, so the last good one is
        known."""
        first, last = self.diverged_at
        trainer.request_stop("diverged", DivergedError(
            f"training (steps {first}-{last})",
            f"{last - first + 1} steps in a row had a non-finite loss or gradient norm "
            f"(train.max_bad_steps={self.guard.max_bad_steps}). The checkpoint of step "
            f"{trainer.step} holds the parameters and optimizer state of step {self.last_good}, "
            f"the last good one, and the data position after step {trainer.step}.",
            "lower optim.lr, lengthen schedule.warmup_steps or set train.grad_clip, then continue "
            "with resume=auto, naming what you changed on purpose (e.g. optim.lr=3e-4 "
            "'resume_changes=[optim.lr]'); or look at the data of those steps."))

    def on_log(self, trainer: Trainer) -> None:
        trainer.record("skipped_steps", self.guard.skipped)

    def _message(self, step: int, verdict: dict, loss: float, grad_norm: float) -> str:
        if "bad_step" in verdict:
            return (f"step {step} skipped: loss {loss}, gradient norm {grad_norm} "
                    f"({self.guard.streak} in a row; the run stops at "
                    f"train.max_bad_steps={self.guard.max_bad_steps}).")
        return (f"loss spike at step {step}: {loss:.4g} is more than train.spike_factor="
                f"{self.guard.spike_factor} times the running average {verdict['loss_ema']:.4g}.")


class SigtermStop(Callback):
    """While the run fits, SIGTERM (what schedulers send before pre-emption or at a time limit)
    stops it, on every rank at the same step, with a checkpoint (Checkpointer): at the next step
    that reads back (a log step), where the ranks compare their flags."""

    def __init__(self):
        self.signal = StopSignal()

    def on_fit_start(self, trainer: Trainer) -> None:
        self.signal.__enter__()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.reads_back and any_rank(self.signal.received, trainer.compute.device):
            trainer.request_stop("SIGTERM")

    def on_close(self, trainer: Trainer) -> None:
        self.signal.__exit__(None, None, None)

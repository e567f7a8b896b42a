"""What a logged step reports besides its loss: throughput and MFU, and the model's own metrics."""

from scalevec_train.parallel.process_group import is_main
from scalevec_train.training.trainer import Callback, StepResult, Trainer


class SpeedMonitor(Callback):
    """Tokens per second over the steps since the last log (the steps' own wall time: evaluation and
    checkpoints do not count), per device, and MFU where the device's peak is known."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float | None,
                 world: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.world = peak_flops, world
        self.steps, self.seconds = 0, 0.0

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.steps += 1
        self.seconds += result.seconds

    def on_log(self, trainer: Trainer) -> None:
        tokens_per_s = self.steps * self.tokens_per_step / self.seconds
        trainer.record("tokens_per_s", tokens_per_s)
        trainer.record("tokens_per_s_per_device", tokens_per_s / self.world)
        if self.peak:
            trainer.record("mfu", tokens_per_s * self.flops_per_token / (self.peak * self.world))
        self.steps, self.seconds = 0, 0.0


class ModelMetrics(Callback):
    """The model's compute_metrics() (MoE load balance) in every logged record, from rank 0 (the
    only one that writes records)."""

    def on_log(self, trainer: Trainer) -> None:
        if is_main():
            for name, value in trainer.model.compute_metrics().items():
                trainer.record(name, value)

"""The FP8 weights' scales, computed after every optimizer step where FSDP all-gathers them in
FP8."""

from torch import nn

from scalevec_train.parallel.fp8 import gathered_in_fp8, precompute_scales
from scalevec_train.training.trainer import Callback, StepResult, Trainer


class Fp8Scales(Callback):
    """Under model.fp8=tensorwise on NCCL (parallel/fp8.py): the scales of the weights FSDP
    all-gathers in FP8, from their new values, in one all-reduce after each step (a skipped step
    leaves the weights and so the scales as they were), instead of one all-reduce per weight in the
    next forward's all-gathers."""

    def __init__(self, weights: list[nn.Parameter]):
        self.weights = weights

    @classmethod
    def of(cls, model: nn.Module) -> list["Fp8Scales"]:
        """The callback for `model` where some weight is all-gathered in FP8; [] otherwise."""
        weights = gathered_in_fp8(model)
        return [cls(weights)] if weights else []

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        precompute_scales(self.weights)

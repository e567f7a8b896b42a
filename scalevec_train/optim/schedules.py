"""Learning-rate schedules: each a pure function of the step, returning a multiplier of the peak LR."""

import math
from dataclasses import dataclass
from typing import Literal

from scalevec_train.errors import ScalevecError, check_choices, choice


@dataclass
class ScheduleConfig:
    # constant | cosine | wsd (warmup-stable-decay)
    name: str = choice("cosine", Literal["constant", "cosine", "wsd"])
    # linear warmup from 0 to the peak LR over this many steps
    warmup_steps: int = 20
    # cosine and wsd: the LR at the end, as a share of the peak (the wsd preset sets 0)
    min_lr_ratio: float = 0.1
    # wsd only: the share of all steps spent in the final decay
    decay_fraction: float = 0.2
    # wsd only: linear | cosine | 1-sqrt
    decay_shape: str = choice("1-sqrt", Literal["linear", "cosine", "1-sqrt"])

    def validate(self, total_steps: int) -> None:
        check_choices(self, "schedule.")
        if not 0 <= self.warmup_steps <= total_steps:
            raise ScalevecError("schedule.warmup_steps",
                                f"{self.warmup_steps} is outside [0, train.steps={total_steps}].",
                                "set a warmup no longer than the run.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ScalevecError("schedule.min_lr_ratio", f"{self.min_lr_ratio} is outside [0, 1].")
        if self.name == "wsd":
            if not 0.0 < self.decay_fraction <= 1.0:
                raise ScalevecError("schedule.decay_fraction", f"{self.decay_fraction} is outside (0, 1].")
            if self.warmup_steps > total_steps - round(self.decay_fraction * total_steps):
                raise ScalevecError("schedule.warmup_steps", "warmup overlaps the WSD decay phase.",
                                    "shorten the warmup or the decay_fraction.")


def lr_multiplier(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """The LR at `step` (0-based: the step about to be taken) as a fraction of the peak LR."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        span = max(total_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_steps = round(cfg.decay_fraction * total_steps)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(decay_steps, 1), 1.0)
    if cfg.decay_shape == "linear":
        shape = 1.0 - progress
    elif cfg.decay_shape == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - math.sqrt(progress)
    return floor + (1.0 - floor) * shape

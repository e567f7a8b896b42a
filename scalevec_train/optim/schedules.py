"""Learning-rate schedules: each a pure function of the step, returning a multiplier of the peak
LR."""

import math

from scalevec_train.optim.config import ScheduleConfig


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

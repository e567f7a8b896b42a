"""The callbacks that observe a run: each has a small job and the trainer's hooks as its interface.

    evaluation.py    Validation: val_loss and val_bpb (bits per byte) on fixed batches; Evaluator
                     records them
    ema.py           WeightEMA: an exponential moving average of the weights, validated as the run
                     goes
    monitors.py      SpeedMonitor: tokens/s and MFU; ModelMetrics: the model's own metrics (MoE
                     load)
    epochs.py        EpochMonitor: passes over the training data, and a warning when they are many
    scales.py        ScaleMonitor: scale-site values and gradient norms
    diagnostics.py   Diagnostics: the paper's mechanism measured every N steps (off by default)
    checkpointer.py  Checkpointer: periodic, final and stop checkpoints
    stability.py     StabilityGuard: non-finite steps and loss spikes; SigtermStop: a clean stop
    watchdog.py      HangWatchdog: collectives' timeouts, and a run that makes no progress ended
    fp8.py           Fp8Scales: the scales of weights all-gathered in FP8, after each step
                     (model.fp8)
    profiler.py      StepProfiler: traces and memory snapshots of chosen steps
    tasks.py         TaskEvaluator: downstream multiple-choice tasks (accuracy, bits per byte)
"""

from scalevec_train.training.callbacks.checkpointer import Checkpointer
from scalevec_train.training.callbacks.diagnostics import Diagnostics
from scalevec_train.training.callbacks.ema import WeightEMA
from scalevec_train.training.callbacks.epochs import EpochMonitor
from scalevec_train.training.callbacks.evaluation import Evaluator, TaskEvaluator
from scalevec_train.training.callbacks.fp8 import Fp8Scales
from scalevec_train.training.callbacks.monitors import ModelMetrics, SpeedMonitor
from scalevec_train.training.callbacks.profiler import StepProfiler
from scalevec_train.training.callbacks.scales import ScaleMonitor
from scalevec_train.training.callbacks.stability import SigtermStop, StabilityGuard
from scalevec_train.training.callbacks.watchdog import HangWatchdog

__all__ = ["Checkpointer", "Diagnostics", "EpochMonitor", "Evaluator", "Fp8Scales", "HangWatchdog",
           "ModelMetrics", "ScaleMonitor", "SigtermStop", "SpeedMonitor", "StabilityGuard",
           "StepProfiler", "TaskEvaluator", "WeightEMA"]

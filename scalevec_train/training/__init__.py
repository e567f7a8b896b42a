"""Training: a loop that steps (trainer.py) and callbacks that observe it (callbacks/), the metrics
logger, the numerical guards, and the training options.

    config.py    TrainConfig (with the weight EMA's EMAConfig), LoggerConfig
    trainer.py   Trainer, Callback, StepResult: the loop, the hooks, trainer.record()
    skip.py      the optimizer step applied where a device flag says, without reading it
    callbacks/   evaluation, throughput, scale statistics, model metrics, checkpoints, stability
    guards.py    the non-finite-step and loss-spike bookkeeping, the SIGTERM flag, fault injection
    logger.py    metrics.jsonl, progress bar, wandb
"""

"""Optimization: parameter groups (which parameter gets which decay and optimizer), AdamW and Muon,
and learning-rate schedules.

    config.py      OptimConfig, ScheduleConfig
    groups.py      the parameter groups, build_optimizer
    muon.py        Muon with AdamW groups in one optimizer (muon_dist.py: orthogonalization under
                   FSDP2)
    schedules.py   the LR multiplier of each step
"""

"""Parallelism, applied to a plain model from outside: the process group, FSDP2/HSDP sharding with its
mixed precision, activation checkpointing and compilation.

    config.py         DistributedConfig
    process_group.py  joining the group under torchrun, rank and world size, small collectives
    fsdp.py           sharding, initialization of shards, gradient sync and clipping
    wrap.py           activation checkpointing and torch.compile of each block
"""

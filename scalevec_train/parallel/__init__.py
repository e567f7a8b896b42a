"""Parallelism, applied to a plain model from outside: the process group, FSDP2/HSDP sharding with
its mixed precision, FP8 matmuls, activation checkpointing and compilation.

    config.py         DistributedConfig
    process_group.py  joining the group under torchrun, rank and world size, small collectives
    data_parallel.py  one process or FSDP2/HSDP shards, initialization, replicated gradients,
                      clipping
    expert_parallel.py  the MoE experts split over an `ep` mesh dimension, tokens sent to them by
                        all-to-all
    wrap.py           activation checkpointing and torch.compile of each block
    fp8.py            model.fp8: torchao's float8 matmuls behind the block maps, FP8 all-gather,
                      scales
"""

"""Process groups and parallelism, applied to the model from outside.

Without torchrun everything here is a no-op on one process.
"""

import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn


def init() -> None:
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return rank() == 0


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def full_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def no_sync(model: nn.Module, last: bool):
    return nullcontext()


def materialize(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate a meta-device model on `device` and initialize it."""
    model = model.to_empty(device=device)
    model.init_weights(seed)
    return model

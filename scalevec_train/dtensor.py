"""What any layer may call on a tensor that may be a DTensor (a shard of a parameter under FSDP2), so
that code below the parallelism layer (the optimizers) handles sharded tensors without importing it."""

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (the same storage), or the tensor itself.
    A DTensor's local view is a new object every time: keep the DTensor, not the view, to find it again."""
    return t.to_local() if isinstance(t, DTensor) else t

"""Shared by the parallel tests: the scale sites set to values that do not depend on the world
size."""

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from scalevec_train.model.strategies import scale_sites


def site_values(model: torch.nn.Module) -> None:
    """The same random values in every site's parameters, on any world size (plain or
    replicated)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, site in scale_sites(model):
            for _, p in sorted(site.named_parameters()):
                value = 1 + 0.3 * torch.randn(p.shape, generator=gen)
                if isinstance(p, DTensor):  # were FSDP to shard a site, it would get its slice
                    value = distribute_tensor(value, p.device_mesh, p.placements,
                                              src_data_rank=None)
                p.copy_(value)

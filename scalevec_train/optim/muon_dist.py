"""Whole-matrix orthogonalization of row-sharded matrices (FSDP2 `Shard(0)`).

Newton-Schulz needs the whole matrix, while FSDP2 leaves each rank a block of rows. Each matrix gets
an owner rank in the shard group; one all-to-all brings every rank's rows of a matrix to its owner,
the owner orthogonalizes, and a second all-to-all returns each rank its rows of the result. Row
blocks follow torch.chunk (ceil(rows / world) rows each, the last ones shorter or empty) and travel
zero-padded to the full block size, so that every message between two ranks has a size both can
compute.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scalevec_train.infra.errors import ScalevecError


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's rows of a row-sharded matrix sit within the shard group."""

    group: dist.ProcessGroup
    rank: int  # this rank's index in `group`
    world: int  # size of `group`


def row_block(rows: int, world: int) -> int:
    """Rows per rank under torch.chunk (which DTensor's Shard and FSDP2 follow); the last may be
    shorter."""
    return -(-rows // world)


def local_row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The global rows [start, stop) held by `rank`; empty past the end of the matrix."""
    block = row_block(rows, world)
    return min(rank * block, rows), min((rank + 1) * block, rows)


def shard_layout(param: torch.Tensor) -> ShardLayout | None:
    """None when this rank holds whole matrices of `param`; otherwise its row-shard layout.

    Whole matrices are local for plain tensors, replicated DTensors, shard groups of one rank, and
    3-D expert stacks sharded on the expert dimension (by FSDP, expert parallelism or both). With
    HSDP's (replicate, shard) mesh only the shard
    dimension takes part: the replicas hold the same rows and repeat the same work.
    """
    if not isinstance(param, DTensor):
        return None
    placements = param.placements
    if any(pl.is_partial() for pl in placements):
        raise ScalevecError("optim (muon)", f"parameter of shape {tuple(param.shape)} has a "
                            "Partial placement.", "reduce it before the optimizer step.")
    shard_dims = [i for i, pl in enumerate(placements) if pl.is_shard()]
    if not shard_dims:
        return None
    if any(placements[i].dim != 0 for i in shard_dims) or (len(shard_dims) > 1 and param.ndim != 3):
        raise ScalevecError("optim (muon)", f"parameter of shape {tuple(param.shape)} has "
                            f"placements {placements}; Muon supports sharding on dim 0 over one "
                            "mesh dimension (an expert stack: over several).",
                            "use fully_shard's default Shard(0) placement (FSDP or HSDP).")
    mesh_dim = shard_dims[0]
    world = param.device_mesh.size(mesh_dim)
    if world == 1 or param.ndim == 3:
        return None
    layout = ShardLayout(param.device_mesh.get_group(mesh_dim),
                         param.device_mesh.get_local_rank(mesh_dim), world)
    start, stop = local_row_range(param.shape[0], world, layout.rank)
    if param.to_local().shape[0] != stop - start:
        raise ScalevecError("optim (muon)", f"local shard of a {tuple(param.shape)} parameter has "
                            f"{param.to_local().shape[0]} rows, torch.chunk gives {stop - start}.",
                            "shard with fully_shard's default Shard(0) placement.")
    return layout


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Owner rank per matrix: largest cost first, each to the least-loaded rank (ties: lowest rank).

    Deterministic from the costs alone, so every rank computes the same assignment without talking.
    """
    loads = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += costs[i]
    return owners


def orthogonalize_sharded(
    local_rows: list[torch.Tensor],
    row_counts: list[int],
    costs: list[float],
    orthogonalize: Callable[[int, torch.Tensor], torch.Tensor],
    out_dtype: torch.dtype,
    layout: ShardLayout,
) -> list[torch.Tensor]:
    """This rank's rows of orthogonalize(i, whole matrix i) for every matrix i of one shard group.

    local_rows[i]: this rank's rows of matrix i (2-D, torch.chunk layout); row_counts[i]: its global
    row count; costs[i]: its Newton-Schulz cost, for balancing owners. All ranks of the group must
    call this with the same matrices in the same order. Results come back as `out_dtype`.
    """
    world, me = layout.world, layout.rank
    owners = assign_owners(costs, world)
    blocks = [row_block(n, world) * t.shape[1] for n, t in zip(row_counts, local_rows, strict=True)]
    owned = [[i for i in range(len(owners)) if owners[i] == o] for o in range(world)]
    # every rank sends owner o the same number of elements: one padded row block per matrix o owns
    to_owner = [sum(blocks[i] for i in owned[o]) for o in range(world)]
    device = local_rows[0].device

    send = torch.zeros(sum(to_owner), dtype=local_rows[0].dtype, device=device)
    offset = 0
    for o in range(world):
        for i in owned[o]:
            flat = local_rows[i].reshape(-1)
            send[offset:offset + flat.numel()].copy_(flat)
            offset += blocks[i]
    gathered = torch.empty(world * to_owner[me], dtype=send.dtype, device=device)
    dist.all_to_all_single(gathered, send, [to_owner[me]] * world, to_owner, group=layout.group)

    # row r of `gathered` is what rank r sent; row r of `reply` is what goes back to rank r
    gathered = gathered.view(world, to_owner[me])
    reply = torch.zeros(world, to_owner[me], dtype=out_dtype, device=device)
    offset = 0
    for i in owned[me]:
        cols = local_rows[i].shape[1]
        piece = gathered[:, offset:offset + blocks[i]]
        whole = piece.reshape(-1, cols)[:row_counts[i]]
        result = orthogonalize(i, whole)
        padded = torch.zeros(piece.numel() // cols, cols, dtype=out_dtype, device=device)
        padded[:row_counts[i]] = result
        reply[:, offset:offset + blocks[i]] = padded.view(world, blocks[i])
        offset += blocks[i]
    returned = torch.empty(sum(to_owner), dtype=out_dtype, device=device)
    dist.all_to_all_single(returned, reply.view(-1), to_owner, [to_owner[me]] * world,
                           group=layout.group)

    results: list[torch.Tensor] = [torch.empty(0)] * len(local_rows)
    offset = 0
    for o in range(world):
        for i in owned[o]:
            rows, cols = local_rows[i].shape
            results[i] = returned[offset:offset + rows * cols].view(rows, cols)
            offset += blocks[i]
    return results

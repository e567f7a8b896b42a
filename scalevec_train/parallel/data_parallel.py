"""Data parallelism: placing and initializing the model (plain on one process, sharded with
FSDP2/HSDP over several), the gradients of the parameters every rank holds whole, and gradient
clipping.

One process (no torchrun, or torchrun with one process) trains the plain model. Several processes
shard it with FSDP2 over a DeviceMesh: `fully_shard` on every transformer block, then on the root.
With `distributed.replicate` > 1 the mesh is (replicate, shard) and FSDP2 runs as HSDP: parameters
are sharded within a group of ranks (a node, by default) and replicated across groups; gradients are
reduce-scattered within the group and all-reduced across groups. With
`distributed.expert_parallel` > 1 the shard dimension also unflattens into (expert_shard, ep), and
the MoE experts are placed on `ep` and sharded over the rest before the blocks are
(expert_parallel.py); gradient clipping then sums the norms of the two meshes. Scale sites are left
whole and fp32 on every rank (replicated_params), their gradients averaged in one all-reduce per
step.

Parameters are built on the meta device, sharded, allocated on the device, and then filled with
their initial values: every rank computes the full initial tensor of a parameter from (seed, name)
(Transformer.initial_value) and keeps its own slice, so the weights never depend on the sharding.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.strategies import scale_sites
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.config import DistributedConfig
from scalevec_train.parallel.expert_parallel import shard_experts
from scalevec_train.parallel.fp8 import convert as convert_fp8
from scalevec_train.parallel.process_group import full_value, world_size
from scalevec_train.parallel.wrap import wrap_block


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward pass reduces gradients across ranks. Off on the inner micro-steps
    of gradient accumulation: gradients accumulate locally (unsharded) and are reduced once, on the
    last."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def mesh_shape(cfg: DistributedConfig, world: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel mesh for `world` ranks."""
    replicate = cfg.replicate
    if replicate == 0:  # one group per node; plain FSDP when nodes run different numbers of ranks
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        replicate = world // per_node if per_node and world % per_node == 0 else 1
    if world % replicate:
        raise ScalevecError("distributed.replicate", f"{replicate} replica groups do not divide "
                            f"the {world} ranks.",
                            "use a divisor of the world size (1: plain FSDP).")
    return replicate, world // replicate


def build_mesh(cfg: DistributedConfig, device: torch.device):
    """The data-parallel mesh, (shard,) or (replicate, shard), and under expert parallelism the same
    ranks with shard unflattened into (expert_shard, ep) (expert_parallel.py; None without)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = mesh_shape(cfg, world_size())
    sizes, names = (((replicate, shard), ("replicate", "shard")) if replicate > 1
                    else ((shard,), ("shard",)))
    mesh = init_device_mesh(device.type, sizes, mesh_dim_names=names)
    ep = cfg.expert_parallel
    # Unflattened from the dense mesh, not the dense mesh flattened from it: torch deprecates
    # slicing a flattened dimension from its root mesh. The dimension by index: torch 2.11 refuses a
    # name it has.
    experts = (mesh._unflatten(names.index("shard"), (shard // ep, ep), ("expert_shard", "ep"))
               if ep > 1 else None)
    return mesh, experts


def uses_bf16(dtype: str, device: torch.device) -> bool:
    """train.dtype resolved: auto means bf16 on GPU and fp32 elsewhere."""
    return dtype == "bf16" or (dtype == "auto" and device.type == "cuda")


def parallelize(model: Transformer, cfg: DistributedConfig, device: torch.device, seed: int,
                dtype: str) -> Transformer:
    """Convert its maps to FP8 (model.fp8), wrap the blocks of a meta-device Transformer (activation
    checkpointing, compile), shard it when there are several processes, and materialize and
    initialize it on `device`."""
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    # FSDP gathers tensorwise FP8 weights in FP8 where the backend has FP8 collectives
    # (NCCL; gloo has none)
    convert_fp8(model, device, all_gather=sharded and model.cfg.fp8 == "tensorwise"
                and dist.get_backend() == "nccl")
    for block in model.layers:
        wrap_block(block, cfg.activation_checkpointing, cfg.compile,
                   fullgraph=cfg.expert_parallel == 1)
    if not sharded:
        model = model.to_empty(device=device)
        model.init_weights(seed)
        return model

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh, expert_mesh = build_mesh(cfg, device)
    # bf16 weights for compute, fp32 gradient reduction, fp32 master weights.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if uses_bf16(dtype, device) else MixedPrecisionPolicy())
    # Scale sites stay whole and fp32 on every rank (docs/concepts/scale-vectors.md's precision
    # rule: FSDP would hand them to the forward in bf16, where their small updates vanish): FSDP
    # ignores them, and their gradients are averaged in one all-reduce per step
    # (reduce_replicated_grads).
    sites = {p for _, site in scale_sites(model) for p in site.parameters()}
    if expert_mesh is not None:
        shard_experts(model, expert_mesh, mp, sites)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=sites)
    # The root's parameters (embedding = tied head) are needed again right at the start of the
    # backward pass: keep them gathered after the forward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=sites)
    model.to_empty(device=device)
    init_sharded(model, seed)
    return model


def reshard(model: nn.Module) -> None:
    """Register every sharded parameter's fp32 shard again where a forward left it gathered (the
    root keeps its parameters gathered after a forward, in the compute dtype); nothing on one
    process. Also what makes the next forward gather anew after weights were written into the shards
    between steps (the weight EMA swapped in for an evaluation, and back)."""
    for module in model.modules():
        if hasattr(module, "reshard"):  # an FSDP2 module
            module.reshard()


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters every rank holds whole (the scale sites under FSDP; none on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if not isinstance(p, DTensor)]


@torch.no_grad()
def reduce_replicated_grads(params: list[nn.Parameter]) -> None:
    """Average the gradients of replicated parameters over all ranks, in one fp32 all-reduce (FSDP
    reduces the sharded ones itself). Every rank must call it, after the step's last backward."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.float().flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for p, part in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = part.view_as(p).to(p.dtype)


@torch.no_grad()
def init_sharded(model: Transformer, seed: int) -> None:
    """Fill every sharded parameter with its slice of Transformer.initial_value, then the
    buffers."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        full = model.initial_value(name, p.shape, seed)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank holds the same full value, so each keeps its slice
            # locally.
            local = distribute_tensor(full, p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
    model.init_buffers()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of every parameter, sharded (DTensor) and replicated alike, to
    max_norm; returns the norm before clipping (as torch.nn.utils.clip_grad_norm_ does), a 0-dim
    tensor on the device: the host need not wait for it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    params = [p for p in model.parameters() if p.grad is not None]
    # One part per mesh (expert parallelism puts the experts on a mesh of their own: torch's norm
    # stacks the norms of one mesh only), and the replicated parameters.
    meshes: dict[object, list[nn.Parameter]] = {}
    for p in params:
        meshes.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    parts = ([part for mesh, part in meshes.items() if mesh is not None]
             + [meshes[m] for m in meshes if m is None])
    if len(parts) == 1:  # one kind: torch's own clipping, bit for bit
        return full_value(torch.nn.utils.clip_grad_norm_(parts[0], max_norm))
    norms = [full_value(torch.nn.utils.get_total_norm([p.grad for p in part])) for part in parts]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    with implicit_replication():  # the plain norm scales the DTensor gradients too
        for part in parts:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return norm

"""Process groups and parallelism, applied to the model from outside.

One process (no torchrun, or torchrun with one process) trains the plain model. Several processes
shard it with FSDP2 over a DeviceMesh: `fully_shard` on every transformer block, then on the root.
With `distributed.replicate` > 1 the mesh is (replicate, shard) and FSDP2 runs as HSDP: parameters
are sharded within a group of ranks (a node, by default) and replicated across groups; gradients are
reduce-scattered within the group and all-reduced across groups.

Parameters are built on the meta device, sharded, allocated on the device, and then filled with their
initial values: every rank computes the full initial tensor of a parameter from (seed, name)
(Transformer.initial_value) and keeps its own slice, so the weights never depend on the sharding.

Activation checkpointing and torch.compile wrap each block's forward in place, so parameter names (and
with them initial values, optimizer groups and checkpoints) are the same under every setting:
  none       keep all activations.
  selective  keep the outputs of matrix multiplies and attention; recompute the cheap element-wise work
             between them (norms, RoPE, SiLU * up) in the backward pass.
  full       keep only each block's input; recompute the whole block in the backward pass.
"""

import os
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from scalevec_train.errors import ScalevecError

AC_MODES = ("none", "selective", "full")


@dataclass
class DistributedConfig:
    # HSDP replica groups: 1 = FSDP over all ranks; k = shard within groups of world/k ranks and
    # replicate across the k groups; 0 = one group per node (world / LOCAL_WORLD_SIZE)
    replicate: int = 0
    # activation checkpointing per block: none | selective (recompute element-wise ops, keep matmul and
    # attention outputs) | full (recompute whole blocks)
    activation_checkpointing: str = "none"
    # torch.compile each transformer block (the first steps are slower while it compiles)
    compile: bool = False

    def validate(self) -> None:
        if self.replicate < 0:
            raise ScalevecError("distributed.replicate", f"{self.replicate} is negative.",
                                "use 0 (one replica group per node), 1 (plain FSDP) or a group count.")
        if self.activation_checkpointing not in AC_MODES:
            raise ScalevecError("distributed.activation_checkpointing",
                                f"unknown mode {self.activation_checkpointing!r}.",
                                f"use one of {', '.join(AC_MODES)}.")


def init() -> None:
    """Join the process group that torchrun describes in the environment (nothing on one process)."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank())
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_attempt_store(rank, world), rank=rank, world_size=world)
        else:
            dist.init_process_group(backend)


def _attempt_store(rank: int, world: int) -> dist.Store:
    """torchrun's key-value store under a prefix that only the processes of this attempt share.

    torchrun hands its workers its own store and keeps it across restarts (--max-restarts), so a new
    attempt can read the addresses an earlier attempt's process group left there and fail to connect
    (pytorch/pytorch#135712). The restart count cannot name the attempt: it differs between nodes. So
    rank 0 publishes a fresh token; every other rank joins under the token it read, with an id of its
    own, and proceeds once rank 0 has answered that id. Rank 0 only answers joins under its own token,
    and ids are new in every process, so no value of an earlier attempt is ever taken for this one.
    """
    from datetime import timedelta

    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=default_pg_timeout)
    me = uuid.uuid4().hex
    if rank == 0:
        store.set("scalevec/leader", me)
        joins = [f"scalevec/{me}/join/{r}" for r in range(1, world)]
        store.wait(joins)
        for key in joins:
            store.set(f"scalevec/answer/{store.get(key).decode()}", me)
        token = me
    else:
        joined, answer = None, f"scalevec/answer/{me}"
        while True:
            leader = store.get("scalevec/leader").decode()
            if leader != joined:  # a stale leader is replaced once this attempt's rank 0 is up
                store.set(f"scalevec/{leader}/join/{rank}", me)
                joined = leader
            try:
                store.wait([answer], timedelta(seconds=1))
                break
            except dist.DistStoreError:
                continue
        token = store.get(answer).decode()
    return dist.PrefixStore(f"scalevec/{token}/", store)


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


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(value):
    """Rank 0's `value` on every rank (a picklable object)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (e.g. a signal that reached only some)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor(float(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (e.g. a gradient norm under FSDP); plain tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm of every parameter, sharded (DTensor) and replicated alike, to
    max_norm; returns the norm before clipping (as torch.nn.utils.clip_grad_norm_ does)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    params = [p for p in model.parameters() if p.grad is not None]
    parts = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    parts = [part for part in parts if part]
    if len(parts) == 1:  # one kind: torch's own clipping, bit for bit
        return full_value(torch.nn.utils.clip_grad_norm_(parts[0], max_norm)).item()
    sharded, whole = parts
    norms = [full_value(torch.nn.utils.get_total_norm([p.grad for p in sharded])),
             torch.nn.utils.get_total_norm([p.grad for p in whole])]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    with implicit_replication():  # the plain norm scales the DTensor gradients too
        torch.nn.utils.clip_grads_with_norm_(sharded, max_norm, norm)
    torch.nn.utils.clip_grads_with_norm_(whole, max_norm, norm)
    return norm.item()


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward pass reduces gradients across ranks. Off on the inner micro-steps of
    gradient accumulation: gradients accumulate locally (unsharded) and are reduced once, on the last."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def mesh_shape(cfg: DistributedConfig, world: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the data-parallel mesh for `world` ranks."""
    replicate = cfg.replicate
    if replicate == 0:  # one group per node; plain FSDP when nodes run different numbers of ranks
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        replicate = world // per_node if per_node and world % per_node == 0 else 1
    if world % replicate:
        raise ScalevecError("distributed.replicate", f"{replicate} replica groups do not divide the "
                            f"{world} ranks.", "use a divisor of the world size (1: plain FSDP).")
    return replicate, world // replicate


def build_mesh(cfg: DistributedConfig, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = mesh_shape(cfg, world_size())
    if replicate == 1:
        return init_device_mesh(device.type, (shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def uses_bf16(dtype: str, device: torch.device) -> bool:
    """train.dtype resolved: auto means bf16 on GPU and fp32 elsewhere."""
    return dtype == "bf16" or (dtype == "auto" and device.type == "cuda")


def parallelize(model: nn.Module, cfg: DistributedConfig, device: torch.device, seed: int,
                dtype: str) -> nn.Module:
    """Wrap the blocks of a meta-device Transformer (activation checkpointing, compile), shard it when
    there are several processes, and materialize and initialize it on `device`."""
    for block in model.layers:
        wrap_block(block, cfg.activation_checkpointing, cfg.compile)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        model = model.to_empty(device=device)
        model.init_weights(seed)
        return model

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from scalevec_train.strategies import scale_sites

    mesh = build_mesh(cfg, device)
    # bf16 weights for compute, fp32 gradient reduction, fp32 master weights.
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if uses_bf16(dtype, device) else MixedPrecisionPolicy())
    # Scale sites stay whole and fp32 on every rank (the spec's precision rule: FSDP would hand them to
    # the forward in bf16, where their small updates vanish): FSDP ignores them, and their gradients are
    # averaged in one all-reduce per step (reduce_replicated_grads).
    sites = {p for _, site in scale_sites(model) for p in site.parameters()}
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=sites)
    # The root's parameters (embedding = tied head) are needed again right at the start of the backward
    # pass: keep them gathered after the forward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=sites)
    model.to_empty(device=device)
    init_sharded(model, seed)
    return model


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
def init_sharded(model: nn.Module, seed: int) -> None:
    """Fill every sharded parameter with its slice of Transformer.initial_value, then the buffers."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        full = model.initial_value(name, p.shape, seed)
        if isinstance(p, DTensor):
            # src_data_rank=None: every rank holds the same full value, so each keeps its slice locally.
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
    model.init_buffers()


# Ops whose outputs selective checkpointing keeps: the matrix multiplies and attention (expensive to
# recompute). Everything else in a block is element-wise or a reduction and is recomputed.
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def wrap_block(block: nn.Module, ac: str, compile_block: bool) -> None:
    """Replace `block.forward` by its checkpointed and/or compiled version. Done on the instance, not
    with a wrapper module, so that parameter names stay as they are."""
    if ac == "none" and not compile_block:
        return
    inner = block.forward
    if ac == "full":
        def forward(*args):
            return checkpoint(inner, *args, use_reentrant=False)
    elif ac == "selective":
        def forward(*args):
            return checkpoint(inner, *args, use_reentrant=False, context_fn=_selective_contexts)
    else:
        forward = inner
    if compile_block:
        forward = torch.compile(forward)
    block.forward = forward

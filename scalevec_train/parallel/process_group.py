"""The process group: joining it under torchrun, how long its collectives may wait, who is who, and
the few collectives the training code uses directly. On one process (no torchrun) every function
does the single-process thing."""

import gc
import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor

from scalevec_train.parallel.config import DistributedConfig

# What NCCL does about a collective that times out, where the user has not said: its flight recorder
# keeps the records of the last 2000 collectives and dumps them on a timeout (to the files that
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE names, /tmp/nccl_trace_rank_<rank> by default; the hang watchdog
# dumps them into run_dir/hang/), for torch's flight-recorder analyser to name the collective and
# the ranks that did not join it.
NCCL_DEFAULTS = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
_timeout: timedelta | None = None  # set_timeout()'s, for the groups made after it


def init(timeout_s: float = DistributedConfig.init_timeout_s) -> None:
    """Join the process group that torchrun describes in the environment (nothing on one process);
    its collectives time out after `timeout_s` (distributed.init_timeout_s) until set_timeout()."""
    if ("WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
            and not dist.is_initialized()):
        global _timeout
        _timeout = timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank())
            for key, value in NCCL_DEFAULTS.items():
                os.environ.setdefault(key, value)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_attempt_store(rank, world, timeout), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)


def set_timeout(timeout_s: float) -> None:
    """From now on every collective of every group this process is in (and of the groups new_group()
    makes) times out after `timeout_s`."""
    global _timeout
    if dist.is_initialized():
        _timeout = timedelta(seconds=timeout_s)
        # the default group, the meshes', the async save's
        for group in list(distributed_c10d._world.pg_map):
            if not distributed_c10d._rank_not_in_group(group):
                distributed_c10d._set_pg_timeout(_timeout, group)


def new_group(backend: str) -> dist.ProcessGroup:
    """A new group of every rank on `backend`, whose collectives time out as the default group's do
    now."""
    return dist.new_group(backend=backend, timeout=_timeout)


def store_client() -> dist.Store | None:
    """A client of the process group's key-value store (torchrun's, or the rendezvous'), of its own:
    a thread may use it while others use the group (None on one process)."""
    return distributed_c10d._get_default_store().clone() if dist.is_initialized() else None


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's key-value store under a prefix that only the processes of this attempt share.

    torchrun hands its workers its own store and keeps it across restarts (--max-restarts), so a new
    attempt can read the addresses an earlier attempt's process group left there and fail to connect
    (pytorch/pytorch#135712). The restart count cannot name the attempt: it differs between nodes.
    So rank 0 publishes a fresh token; every other rank joins under the token it read, with an id of
    its own, and proceeds once rank 0 has answered that id. Rank 0 only answers joins under its own
    token, and ids are new in every process, so no value of an earlier attempt is ever taken for
    this one.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
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


def shutdown(finished: bool = False) -> None:
    """Leave the process group (after a run every rank finished, together: no peer still in its last
    collective sees the connections close) and free it, which ends its threads.

    destroy_process_group() frees only the groups nothing else holds, and a gloo group's worker
    threads run until it is freed. A DeviceMesh holds its groups, and torch's DTensor caches
    (redistribution plans) hold every mesh a DTensor used for the life of the process, so the
    threads ran on into interpreter finalization. A worker that let go of a finished collective
    after the main thread had begun finalizing had to take the GIL to release the work's tensors;
    Python ends such a thread with pthread_exit, whose unwinding through the work's noexcept
    destructor calls std::terminate ("terminate called without an active exception", SIGABRT, after
    a run that had saved everything; docs/guides/reliability.md, "Leaving cleanly"). Unlinking every
    mesh from its groups and collecting frees the groups here, and freeing one joins its workers
    (with the GIL released) while Python is whole. The caller must no longer hold the run's model or
    checkpointer: FSDP and the async checkpoint hold groups too."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
        _release_groups()


def _release_groups() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # type(), not isinstance: no attribute lookups on proxies
        if issubclass(type(obj), DeviceMesh):
            # where torch 2.11 to 2.13 keep a mesh's groups
            vars(obj).get("_pg_registry", {}).clear()
    gc.collect()


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


def gather_all(value) -> list:
    """Every rank's `value` (a picklable object), in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        t = all_reduce_sum(t)
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
    """The whole tensor behind a DTensor (e.g. a gradient norm under FSDP); plain tensors as they
    are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard (the same storage), or the tensor
    itself. A DTensor's local view is a new object every time: keep the DTensor, not the view, to
    find it again."""
    return t.to_local() if isinstance(t, DTensor) else t

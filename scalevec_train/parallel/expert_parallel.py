"""Expert parallelism (`distributed.expert_parallel=EP`): the routed experts of every MoE layer
split over groups of EP ranks, the tokens sent to them by all-to-all.

The data-parallel ranks of a replica group (all ranks under FSDP) form a mesh (expert_shard, ep), ep
the inner dimension (EP consecutive ranks), unflattened from the "shard" dimension that shards the
rest of the model as without EP. Each expert stack is a DTensor placed Shard(0) on `ep` (rank r of
an EP group holds experts [r E/EP, (r+1) E/EP)), and FSDP shards it further over expert_shard (and
replicates it over HSDP's replicate dimension), so a rank's shard is whole expert matrices (Muon
orthogonalizes them where they lie). The experts' per-expert scale sites stay whole on every rank,
as every site does (data_parallel.py): a rank uses its experts' rows, and the one all-reduce of the
sites' gradients sums each row's contributions from its owners, as it sums any site's.

Every rank routes its own tokens (router, expert bias, auxiliary losses and their metrics are those
of the layer without EP: the bias update sums the counts over all ranks either way). ExpertDispatch,
which the MoE layer calls in place of running all experts here, sends each row (sorted by expert, so
each destination's rows are contiguous) with its routing weight to the rank holding its expert, runs
the local experts on what arrived (sorted by expert again), and sends the outputs back: two
differentiable all_to_all_single with uneven splits, plus one of the per-expert counts.

Gradient scale: an expert's gradient on its owner sums the contributions of the EP ranks' tokens,
and FSDP's reduction over (replicate, expert_shard) averages over R F of the R F EP ranks; the 1/EP
applied in the backward of the local weights makes it the mean over all ranks, as for every other
parameter. (FSDP's own divide factor needs PREMUL_SUM, which gloo lacks; forcing a sum reduction is
wrong where expert_shard is 1.)
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.moe import RoutedExperts
from scalevec_train.parallel.config import DistributedConfig
from scalevec_train.parallel.process_group import local


def check(cfg: DistributedConfig, num_experts: int | None, world: int, replicate: int) -> None:
    """Refuse an expert-parallel degree the run cannot have (before any work); `replicate`: HSDP's
    replica groups on `world` ranks."""
    ep = cfg.expert_parallel
    if ep == 1:
        return
    where = "distributed.expert_parallel"
    if num_experts is None:
        raise ScalevecError(where, f"{ep} on a dense model (model.moe is null).",
                            "use distributed.expert_parallel=1, or an MoE model "
                            "(e.g. model=moe-tiny).")
    if ep > world:
        raise ScalevecError(where, f"{ep} is larger than the world size ({world} ranks).",
                            f"use at most {world}, or launch more ranks.")
    shard = world // replicate
    if shard % ep:
        raise ScalevecError(where, f"{ep} does not divide the {shard} ranks of a replica group "
                            f"({world} ranks, {replicate} replica groups).",
                            "use a divisor of the ranks per replica group "
                            "(distributed.replicate sets the groups).")
    if num_experts % shard:
        raise ScalevecError(where, f"model.moe.num_experts={num_experts} do not split over "
                            f"expert_parallel x expert-FSDP = {ep} x {shard // ep} ranks "
                            "(whole experts on every rank).",
                            f"use a number of experts divisible by {shard}, or more replica groups "
                            "(distributed.replicate), or fewer ranks.")


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class ExpertDispatch:
    """The MoE layer's RoutedExperts.dispatch on one rank of an EP group
    (model/moe.py, ExpertDispatch)."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def __call__(self, experts: RoutedExperts, xs_gate: torch.Tensor, xs_up: torch.Tensor,
                 gates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, n = self.size, counts.numel() // self.size
        # received[i n + e]: the rows rank i sends to this rank's expert e
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # the one host read of a layer under EP: the uneven splits the collectives take
        send, recv = torch.stack([counts.view(ep, n).sum(1), received.view(ep, n).sum(1)]).tolist()
        dim = xs_gate.shape[-1]
        parts = [xs_gate] if xs_up is xs_gate else [xs_gate, xs_up]
        got = all_to_all_single_autograd(torch.cat([*parts, gates.unsqueeze(-1)], -1), recv, send,
                                         self.group)
        # rows arrive by source rank, then by expert: sorted by expert for the grouped matmuls
        # (output_size known: no second read)
        arrived_of = torch.arange(n, device=counts.device).repeat(ep).repeat_interleave(
            received, output_size=sum(recv))
        order = arrived_of.argsort(stable=True)
        got = got.index_select(0, order)
        # copies with rows of their own (grouped_mm wants them aligned to 16 bytes; contiguous()
        # keeps the strides of an empty slice, when no row arrived)
        g_gate = got[:, :dim].clone(memory_format=torch.contiguous_format)
        g_up = (g_gate if xs_up is xs_gate
                else got[:, dim:2 * dim].clone(memory_format=torch.contiguous_format))
        stacks = tuple(_ScaleGrad.apply(local(w), 1 / ep) for w in experts.weights())
        first = self.rank * n
        out = experts.compute(g_gate, g_up, got[:, -1], received.view(ep, n).sum(0),
                              arrived_of.index_select(0, order), stacks, slice(first, first + n))
        inverse = torch.empty_like(order).scatter_(0, order,
                                                   torch.arange(order.numel(), device=order.device))
        return all_to_all_single_autograd(out.index_select(0, inverse), send, recv, self.group)


def shard_experts(model: nn.Module, mesh, mp_policy, ignored: set[nn.Parameter]) -> None:
    """Place every routed expert stack of a meta-device model Shard(0) on the mesh's `ep` dimension,
    shard it with FSDP over the rest of the data-parallel dimensions, and install the dispatch."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = mesh["ep"]
    fsdp_mesh = (mesh["replicate", "expert_shard"] if "replicate" in mesh.mesh_dim_names
                 else mesh["expert_shard"])
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            part = p.detach().chunk(ep)[rank]
            module.register_parameter(name, nn.Parameter(
                DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False)))
        module.dispatch = ExpertDispatch(ep_mesh.get_group(), ep, rank)
        fully_shard(module, mesh=fsdp_mesh, mp_policy=mp_policy, ignored_params=ignored)

"""Per-rank memory of a training run, before the run: what a config needs on each of `world` ranks,
against the device's memory, with the change that makes it fit when it does not.

Counted from the config on the meta device (no weights are allocated):
  params, grads      fp32 master weights and their gradients: sharded over the FSDP group (the scale
                     sites whole on every rank); the whole model on one process.
  accumulated_grads  under FSDP with gradient accumulation, every rank holds the whole model's fp32
                     gradients between micro-steps (the reduce-scatter waits for the last one).
  optimizer          AdamW: exp_avg + exp_avg_sq (fp32) and a step count per tensor; Muon: a fp32
                     momentum per hidden matrix, AdamW's state for the rest.
  skip_copies        the copies of parameters, optimizer state and buffers that training/skip.py
                     keeps between steps to undo a skipped one, for the optimizer that cannot skip
                     it itself: torch's for-loop AdamW (CPU). None for fused AdamW (CUDA) and Muon.
  ema                the weight EMA (train.ema.half_life_tokens): a fp32 copy of the rank's share of
                     the parameters and of the floating-point buffers a checkpoint holds.
  activations        what autograd keeps through one micro-batch's forward (activations.py), for the
                     activation-checkpointing mode; `recompute`: one block's tensors again during
                     its backward when blocks are checkpointed.
  logits             the logits and their fp32 upcast for the loss, then their gradients.
  fsdp_buffers       unsharded compute-dtype parameters of the root and of two blocks (the current
                     one and the prefetched one; under model.fp8=tensorwise the maps it converts are
                     gathered in FP8, 1 byte each: parallel/fp8.py), and one block's unsharded
                     gradients being reduced;
                     under expert parallelism a block's routed experts are those of the rank's EP
                     slice only (the all-to-all's rows are the sorted rows a rank keeps without EP,
                     on balanced routing: activations as without EP).
  optimizer_step     Muon's transient copies: the update, the exchange of whole matrices with their
                     owner ranks, Newton-Schulz's workspace on the largest matrix and its new value
                     before it is selected into place (its skip on the device); the new value,
                     denominator and update of the largest AdamW-group tensor (the activations are
                     gone by then).
The peak is the larger of the backward's (states + activations + recompute + logits + FSDP buffers)
and the optimizer step's (states + optimizer_step), plus OVERHEAD.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from scalevec_train.config import Config
from scalevec_train.costs.activations import (
    Precision,
    block_bytes,
    block_kept_bytes,
    logits_peak_bytes,
    outer_bytes,
    weight_copy_bytes,
)
from scalevec_train.model.moe import RoutedExperts
from scalevec_train.model.plan import ScalePlan
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import param_groups
from scalevec_train.parallel.fp8 import map_precisions

GB = 10**9
# CUDA context, NCCL buffers and the caching allocator's fragmentation: an allowance, not a count.
OVERHEAD = 3 * GB
# distributed.replicate=0 makes one replica group per node; describe assumes nodes of this many
# GPUs.
RANKS_PER_NODE = 8
FP32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank."""

    world_size: int
    shard_size: int  # ranks one parameter is sharded over (1: not sharded)
    device: str  # cuda | cpu
    activation_checkpointing: str
    micro_batch_tokens: int
    accumulation: int  # micro-batches per optimizer step
    params: int
    grads: int
    accumulated_grads: int
    optimizer: int
    skip_copies: int
    ema: int
    activations: int
    recompute: int
    logits: int
    fsdp_buffers: int
    optimizer_step: int
    overhead: int

    @property
    def states(self) -> int:
        return (self.params + self.grads + self.accumulated_grads + self.optimizer
                + self.skip_copies + self.ema)

    @property
    def total(self) -> int:
        backward = self.activations + self.recompute + self.logits + self.fsdp_buffers
        return self.states + max(backward, self.optimizer_step) + self.overhead

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), total=self.total)


def shard_size(cfg: Config, world: int) -> int:
    """Ranks a parameter is sharded over: the whole world, or a node's ranks under HSDP."""
    replicate = cfg.distributed.replicate
    if replicate == 0:
        replicate = world // min(world, RANKS_PER_NODE)
    return max(1, world // max(1, replicate))


def precision(cfg: Config, device: str, world: int) -> Precision:
    if device == "cpu":
        return Precision.cpu(bf16=cfg.train.dtype == "bf16")
    bf16 = cfg.train.dtype in ("auto", "bf16")
    # kernels=auto runs the reference only inside torch.compile (scalevec_kernels/choice.py), whose
    # graph keeps what the kernels keep: the norm's input and 1/rms (inductor's partitioner;
    # measured on CPU)
    return Precision.gpu(sharded=world > 1, bf16=bf16, fused=cfg.model.kernels != "torch")


def activation_bytes(cfg: Config, plan: ScalePlan, p: Precision) -> tuple[float, float]:
    """(kept through the forward, recomputed during one block's backward) per token."""
    m, mode = cfg.model, cfg.distributed.activation_checkpointing
    block = block_bytes(m, plan.blocks[0], p)
    outer = outer_bytes(m, plan.final_norm, p)
    if mode == "none":
        return m.n_layers * block + outer, 0.0
    kept = sum(block_kept_bytes(m, b, p, mode, first=i == 0) for i, b in enumerate(plan.blocks))
    return kept + outer, block


def estimate(cfg: Config, world: int, device: str = "cuda") -> MemoryEstimate:
    """The per-rank memory of training `cfg` on `world` ranks (cfg composed for that world size, so
    that its derived micro-batch is the one each rank runs)."""
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    names = model.plan.site_parameters()
    sites = {id(p) for n, p in model.named_parameters() if n in names}
    shard = shard_size(cfg, world) if world > 1 else 1
    p = precision(cfg, device, world)

    def local(params) -> float:
        """Elements this rank holds of `params`: sites whole, the rest sharded."""
        return sum(t.numel() if id(t) in sites else t.numel() / shard for t in params)

    params = list(model.parameters())
    held = local(params)
    optimizer, muon, adamw = 0.0, [], []
    for group in param_groups(model, cfg.optim):
        if group.get("use_muon", False):
            optimizer += FP32 * local(group["params"])
            muon += group["params"]
        else:
            optimizer += 2 * FP32 * local(group["params"]) + FP32 * len(group["params"])
            adamw += group["params"]
    skip_copies = 0.0
    if cfg.optim.name != "muon" and device == "cpu":
        skip_copies = FP32 * held + optimizer + sum(b.numel() * b.element_size()
                                                    for b in model.buffers())
    ema = 0.0
    if cfg.train.ema.half_life_tokens:
        param_ids = {id(p) for p in params}
        ema = FP32 * (held + sum(t.numel() for t in model.state_dict(keep_vars=True).values()
                                 if id(t) not in param_ids and t.is_floating_point()))
    accumulation = cfg.train.global_batch // (cfg.train.micro_batch * world)
    sharded = sum(t.numel() for t in params if id(t) not in sites)
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    kept, recompute = activation_bytes(cfg, model.plan, p)
    # weight copies: a checkpointed block makes its own again when it is recomputed
    copies, block_copies = weight_copy_bytes(model, p), weight_copy_bytes(model, p, block=0)
    if cfg.distributed.activation_checkpointing == "none":
        kept_copies, recompute_copies = copies, 0.0
    else:
        kept_copies, recompute_copies = copies - cfg.model.n_layers * block_copies, block_copies

    fsdp = 0.0
    if world > 1:
        root = sum(t.numel() for n, t in model.named_parameters()
                   if not n.startswith("layers.") and id(t) not in sites)
        # each rank gathers its EP slice of the experts (expert_parallel.py)
        slices = {id(t): cfg.distributed.expert_parallel for m in model.modules()
                  if isinstance(m, RoutedExperts) for t in m.weights()}
        # FP8's all-gather (NCCL: describe's GPUs) hands the converted maps' weights on in 1 byte
        fp8 = ({id(model.get_parameter(r.name)) for r in map_precisions(model) if r.fp8}
               if cfg.model.fp8 == "tensorwise" else set())

        def gathered(b: nn.Module) -> list[tuple[float, int]]:
            """(elements, bytes each) of the parameters FSDP gathers for block b"""
            return [(t.numel() / slices.get(id(t), 1), 1 if id(t) in fp8 else p.compute)
                    for t in b.parameters() if id(t) not in sites]

        block = max((gathered(b) for b in model.layers), key=lambda g: sum(n for n, _ in g))
        fsdp = (p.compute * root + 2 * sum(n * nbytes for n, nbytes in block)
                + (p.compute + FP32) * sum(n for n, _ in block))
    step = 0.0
    if muon:
        largest = max(t.numel() for t in muon)
        ns_bytes = torch.empty((), dtype=getattr(torch, cfg.optim.ns_dtype)).element_size()
        # the update and the matrices exchanged with their owners (sent, gathered, reply, returned)
        exchange = ((FP32 + FP32 + FP32 + 2 * ns_bytes) * sum(t.numel() for t in muon) / shard
                    if world > 1 else 0)
        # Newton-Schulz: x, gram, poly, new x; then the new parameter
        step = exchange + 2 * FP32 * largest + 4 * ns_bytes * largest
        step = max(step, 3 * FP32 * max((local([t]) for t in adamw), default=0))
    return MemoryEstimate(
        world_size=world, shard_size=shard, device=device,
        activation_checkpointing=cfg.distributed.activation_checkpointing,
        micro_batch_tokens=tokens, accumulation=accumulation,
        params=round(FP32 * held), grads=round(FP32 * held),
        accumulated_grads=FP32 * sharded if world > 1 and accumulation > 1 else 0,
        optimizer=round(optimizer), skip_copies=round(skip_copies), ema=round(ema),
        activations=round(tokens * kept + kept_copies),
        recompute=round(tokens * recompute + recompute_copies),
        logits=round(tokens * logits_peak_bytes(cfg.model, p)), fsdp_buffers=round(fsdp),
        optimizer_step=round(step), overhead=OVERHEAD if device == "cuda" else 0)


def fix(cfg: Config, world: int, device_bytes: float, device: str = "cuda") -> str | None:
    """The smallest change that makes `cfg` fit on `world` ranks (None when it fits): activation
    checkpointing, then a smaller micro-batch, then more ranks."""
    if estimate(cfg, world, device).total <= device_bytes:
        return None
    modes = ("selective", "full")
    current = cfg.distributed.activation_checkpointing
    for mode in modes[modes.index(current) + 1 if current in modes else 0:]:
        ac = dataclasses.replace(cfg.distributed, activation_checkpointing=mode)
        trial = dataclasses.replace(cfg, distributed=ac)
        if estimate(trial, world, device).total <= device_bytes:
            return f"distributed.activation_checkpointing={mode}"
    per_rank = cfg.train.global_batch // world
    for micro in sorted((d for d in range(1, cfg.train.micro_batch) if per_rank % d == 0),
                        reverse=True):
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=micro))
        if estimate(trial, world, device).total <= device_bytes:
            return f"train.max_micro_batch_tokens={micro * cfg.train.seq_len} (micro-batch {micro})"
    return "more ranks (parameters, gradients and optimizer state shard over them)"

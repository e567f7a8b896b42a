"""What expert parallelism sends between ranks per optimizer step, predicted from the config
(describe reports it; tests/parallel/test_expert_parallel.py checks it against what a 2-rank run's
all-to-alls move).

Every MoE layer sends each routed row (a token's copy for one of its top_k experts) whose expert
lives on another rank of its EP group there and back (parallel/expert_parallel.py): the dispatch
carries the expert's input (two, dim wide each, where gate and up read different branches) and the
routing weight, the combine the expert's output (dim), all in the compute dtype. The backward sends
the gradients of both, of the same sizes; activation checkpointing runs the forward's again when it
recomputes a block (`full`; `selective` keeps only matmul and attention outputs, so it recomputes
them too). Routing is taken as balanced: a row's expert is on another rank with probability
(EP - 1) / EP. The exchange of the per-expert counts (E integers per rank and layer) is left out.
"""

from dataclasses import dataclass

from scalevec_train.config import Config
from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.transformer import Transformer


@dataclass(frozen=True)
class AllToAll:
    """Bytes one rank sends to the other ranks of its EP group per optimizer step."""

    rows: float  # routed rows sent off-rank per step, dispatch (forward) only
    dispatch_row: int  # bytes of one dispatched row
    combine_row: int  # bytes of one combined row
    # forward passes of each all-to-all per step: 1, or 2 under activation checkpointing
    forwards: int

    @property
    def total(self) -> float:
        """Forward (dispatch and combine, `forwards` times) and backward (their gradients)."""
        return self.rows * (self.dispatch_row + self.combine_row) * (self.forwards + 1)


def expert_all_to_all(cfg: Config, model: Transformer, world: int,
                      compute_bytes: int) -> AllToAll | None:
    """The all-to-all traffic of `model` (built from cfg) on `world` ranks, in a compute dtype of
    `compute_bytes`; None without expert parallelism."""
    ep = cfg.distributed.expert_parallel
    if ep == 1 or cfg.model.moe is None:
        return None
    layers = [b.ffn for b in model.layers if isinstance(b.ffn, MoEFeedForward)]
    dim, k = cfg.model.dim, cfg.model.moe.top_k
    separate = {layer.reads[1] != layer.reads[2] for layer in layers}
    assert len(separate) == 1, "every MoE layer reads its experts' inputs alike"
    accumulation = cfg.train.global_batch // (cfg.train.micro_batch * world)
    tokens = accumulation * cfg.train.micro_batch * cfg.train.seq_len
    rows = len(layers) * tokens * k * (ep - 1) / ep
    forwards = 1 if cfg.distributed.activation_checkpointing == "none" else 2
    return AllToAll(rows, ((2 if separate.pop() else 1) * dim + 1) * compute_bytes,
                    dim * compute_bytes, forwards)

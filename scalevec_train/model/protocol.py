"""What the training, parallel and checkpoint code call on a model, written as a type.

A model is an nn.Module mapping tokens [batch, seq] (and, as a keyword, the loader's document ids
[batch, seq] or None: docs/data.md) to logits [batch, seq, vocab] that also offers the methods below;
model.Transformer is one, dense or MoE. The trainer types its model argument with TrainableModel, so
that a model that lacks one of these fails the type check rather than the run, and
tests/model/test_protocol.py checks that every preset's model satisfies it.
"""

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from scalevec_train.model.parameterization import Parameterization
from scalevec_train.model.plan import ScalePlan
from scalevec_train.model.strategies import SiteMaps


@runtime_checkable
class TrainableModel(Protocol):
    # The transformer blocks, in order: what activation checkpointing, compilation and FSDP wrap.
    layers: nn.ModuleList
    # Every scale site the model has (plan.py): the optimizer's groups and FSDP's replicated sites read it.
    plan: ScalePlan
    # How init, LRs and the forward's multipliers follow width and depth (model.parameterization).
    parameterization: Parameterization

    def __call__(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; doc_ids confine attention to documents where the model's config asks for it."""

    def auxiliary_loss(self) -> torch.Tensor | None:
        """A loss of the last forward to add to the training loss (MoE routers), or None."""

    def discard_step_state(self) -> None:
        """Forget what the forwards of the current optimizer step recorded (after every step: a taken
        step has used it already, a skipped one must not leave it to the next)."""

    def update_after_step(self, taken: torch.Tensor | None = None) -> None:
        """The updates that follow each optimizer step (MoE expert biases), only where the 0-dim bool
        `taken` is true if given (training/skip.py): call it after every optimizer step."""

    def compute_metrics(self) -> dict[str, float]:
        """The model's own metrics for a logged step (MoE load balance); read on log steps only."""

    def site_maps(self) -> list[SiteMaps]:
        """Every scale site with the linear maps it scales (strategies.SiteMaps), from the plan's rows:
        the diagnostics' input-side scales."""

    def initial_value(self, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
        """The initial value of parameter `name`: a function of (seed, name) only, never of sharding."""

    def init_weights(self, seed: int) -> None:
        """Initialize every parameter and buffer in place (one process)."""

    def init_buffers(self) -> None:
        """Initialize the buffers in place (after the parameters, also under FSDP)."""

    # nn.Module's own, used as they are.
    def parameters(self, recurse: bool = True): ...

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True): ...

    def buffers(self, recurse: bool = True): ...

    def train(self, mode: bool = True): ...

    def eval(self): ...

"""Folding: absorb every foldable scale site into the adjacent linear map (docs/scale-vectors.md, "Folding").

Each row of the model's plan says how its site folds: input sites into their maps' columns
(W <- W diag(s)), output sites without a normalization into their maps' rows (W <- diag(u) W); sites
behind a normalization stay as that normalization's weight (an `or`/`er` one becomes a plain vector with
the same s). The folded model computes the same function and carries the folded plan, whose sites are
exactly what it has left; a `baseline` model becomes a Llama model whose norms carry no weights.
"""

import copy
import dataclasses

import torch
from torch import nn

from scalevec_train.model.plan import Fold, ScalePlan
from scalevec_train.model.strategies import ScaleSite
from scalevec_train.model.transformer import Transformer


def _replace(model: nn.Module, path: str, site: ScaleSite) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, site) if parent else setattr(model, name, site)


@torch.no_grad()
def fold(model: Transformer) -> Transformer:
    """A folded copy of `model` (the original is left untouched)."""
    folded = copy.deepcopy(model)
    if folded.head is None and folded.plan.final.fold is Fold.COLUMNS:
        # The head will absorb the final scale, so it can no longer be the embedding table.
        folded.head = nn.Linear(folded.cfg.dim, folded.cfg.vocab_size, bias=False)
        folded.head.weight.copy_(folded.tok_emb.weight)
        folded.cfg = dataclasses.replace(folded.cfg, tie_embeddings=False)
    plan, after = ScalePlan.build(folded.cfg, folded.scale), ScalePlan.build(folded.cfg, folded.scale, folded=True)
    for row, new in zip(plan.rows, after.rows, strict=True):
        if row.fold is Fold.NONE or (row.fold is Fold.KEEP and row.param == "plain"):
            continue
        s = folded.get_submodule(row.path)()
        site = ScaleSite.of(new)
        if row.fold is Fold.KEEP:
            site.scale.copy_(s)
        else:
            for target in row.maps:
                folded.get_parameter(target.weight).mul_(s.unsqueeze(-2 if row.fold is Fold.COLUMNS else -1))
        _replace(folded, row.path, site)
    folded.plan = after
    return folded

"""Folding: absorb every foldable scale site into the adjacent linear map (docs/scale-vectors.md, "Folding").

Input sites fold into the next map's columns (W <- W diag(s)); output sites without a normalization
fold into the previous map's rows (W <- diag(u) W); sites behind a normalization stay as that
normalization's weight (an `or`/`er` one becomes a plain vector with the same s). The folded model
computes the same function with no foldable site left; a `baseline` model becomes a Llama model whose
norms carry no weights.
"""

import copy
import dataclasses

import torch
from torch import nn

from scalevec_train.model.strategies import ScaleSite, scale_sites
from scalevec_train.model.transformer import Transformer


def _replace(model: nn.Module, path: str, site: ScaleSite) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, site) if parent else setattr(model, name, site)


@torch.no_grad()
def fold(model: Transformer) -> Transformer:
    """A folded copy of `model` (the original is left untouched)."""
    folded = copy.deepcopy(model)
    final = folded.final_norm.sites["final"]
    if folded.head is None and final.foldable:
        # The head will absorb the final scale, so it can no longer be the embedding table.
        folded.head = nn.Linear(folded.cfg.dim, folded.cfg.vocab_size, bias=False)
        folded.head.weight.copy_(folded.tok_emb.weight)
        folded.cfg = dataclasses.replace(folded.cfg, tie_embeddings=False)
    paths = {id(site): path for path, site in scale_sites(folded)}
    for entry in folded.site_maps():
        site = entry.site
        s = site()
        if s is None:
            continue
        if not site.foldable:
            if site.param != "plain":
                plain = ScaleSite(site.shape, site.role, "plain", behind_norm=True)
                plain.scale.copy_(s)
                _replace(folded, paths[id(site)], plain)
            continue
        for target in entry.maps:
            target.weight.mul_(s.unsqueeze(-2) if entry.side == "in" else s.unsqueeze(-1))
        _replace(folded, paths[id(site)], ScaleSite(site.shape, site.role, "fixed", behind_norm=site.behind_norm))
    return folded

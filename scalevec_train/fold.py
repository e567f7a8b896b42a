"""Folding: absorb every foldable scale site into the adjacent linear map (spec, "Folding").

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

from scalevec_train.model import Linear, Transformer
from scalevec_train.strategies import ScaleSite, scale_sites


def _consumers(model: Transformer) -> dict[int, list[torch.Tensor]]:
    """For every pre-norm input site (by id): the weights whose input it scales."""
    found: dict[int, list[torch.Tensor]] = {}
    for block in model.layers:
        for branch, site in block.attn_norm.sites.items():
            found[id(site)] = block.attn.input_weights(branch)
        for branch, site in block.ffn_norm.sites.items():
            found[id(site)] = block.ffn.input_weights(branch)
    head = model.tok_emb.weight if model.head is None else model.head.weight
    found[id(model.final_norm.sites["final"])] = [head]
    return found


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
    consumers = _consumers(folded)
    owners = {}
    for module in folded.modules():
        if isinstance(module, Linear):
            for which in ("in_site", "out_site"):
                site = getattr(module, which)
                if site is not None:
                    owners.setdefault(id(site), []).append((module.weight, which))
        if hasattr(module, "fold_pairs"):  # MoE experts fold their own internal sites
            for site, weight, which in module.fold_pairs():
                owners.setdefault(id(site), []).append((weight, which))
    for path, site in scale_sites(folded):
        s = site()
        if s is None:
            continue
        if not site.foldable:
            if site.param != "plain":
                plain = ScaleSite(site.shape, site.role, "plain", behind_norm=True)
                plain.scale.copy_(s)
                _replace(folded, path, plain)
            continue
        if id(site) in consumers:
            for weight in consumers[id(site)]:
                weight.mul_(s.unsqueeze(-2))
        else:
            # A site may scale several maps (an MoE output site: the experts and the shared expert).
            for weight, which in owners[id(site)]:
                weight.mul_(s.unsqueeze(-2) if which == "in_site" else s.unsqueeze(-1))
        _replace(folded, path, ScaleSite(site.shape, site.role, "fixed", behind_norm=site.behind_norm))
    return folded

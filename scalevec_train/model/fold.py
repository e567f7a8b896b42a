"""Folding: absorb every foldable scale site into the adjacent linear map
(docs/concepts/scale-vectors.md, "Folding").

Each row of the model's plan says how its site folds: input sites into their maps' columns (W <- W
diag(s)), output sites without a normalization into their maps' rows (W <- diag(u) W); sites behind
a normalization stay as that normalization's weight (an `or`/`er` one becomes a plain vector with
the same s). The folded model computes the same function and carries the folded plan, whose sites
are exactly what it has left; a `baseline` model becomes a Llama model whose norms carry no weights.

Under model.parameterization=mup the forward's multipliers (parameterization.py) fold too, so that
the folded model is an sp model computing the same function: the logits' into an untied head, the
routers' into the routers, the attention scale's ratio to 1 / sqrt(head_dim) into q, each residual
branch's into the map that ends it (o, down), or into its output site where a normalization ends it.
"""

import copy
import dataclasses

import torch
from torch import nn

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.parameterization import Parameterization
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
    readout = folded.parameterization.readout
    if folded.head is None and (folded.plan.final.fold is Fold.COLUMNS or readout != 1):
        # The head will absorb the final scale, so it can no longer be the embedding table.
        folded.head = nn.Linear(folded.cfg.dim, folded.cfg.vocab_size, bias=False)
        folded.head.weight.copy_(folded.tok_emb.weight)
        folded.cfg = dataclasses.replace(folded.cfg, tie_embeddings=False)
    plan, after = (ScalePlan.build(folded.cfg, folded.scale),
                   ScalePlan.build(folded.cfg, folded.scale, folded=True))
    for row, new in zip(plan.rows, after.rows, strict=True):
        if row.fold is Fold.NONE or (row.fold is Fold.KEEP and row.param == "plain"):
            continue
        s = folded.get_submodule(row.path)()
        site = ScaleSite.of(new)
        if row.fold is Fold.KEEP:
            site.scale.copy_(s)
        else:
            for target in row.maps:
                folded.get_parameter(target.weight).mul_(
                    s.unsqueeze(-2 if row.fold is Fold.COLUMNS else -1))
        _replace(folded, row.path, site)
    folded.plan = after
    _fold_multipliers(folded)
    return folded


def _scale_output(weight: torch.Tensor, site: ScaleSite | None, norm, m: float) -> None:
    """Multiply a map's output by m: through its output site when a normalization follows the map
    (the site, plain after folding, is that normalization's weight), else through its weight's
    rows."""
    if norm is None:
        weight.mul_(m)
    elif site is not None and site.param == "plain":
        site.scale.mul_(m)
    else:
        raise ScalevecError("model.parameterization",
                            "a multiplier of the mup model cannot fold into a "
                            "normalization without a weight (a fixed site behind it).",
                            "export a model whose strategy gives that normalization a site (any "
                            "but scale=none).")


def _fold_multipliers(folded: Transformer) -> None:
    p = folded.parameterization
    if p.name == "sp":
        return
    if p.readout != 1:
        folded.head.weight.mul_(p.readout)
    for block in folded.layers:
        attn, ffn = block.attn, block.ffn
        if attn.scale is not None:
            _scale_output(attn.wq.weight, attn.wq.out_site, attn.wq.out_norm,
                          attn.scale * attn.head_dim**0.5)
            attn.scale = None
        if block.branch != 1:
            _scale_output(attn.wo.weight, attn.wo.out_site, attn.wo.out_norm, block.branch)
            if isinstance(ffn, MoEFeedForward):
                if ffn.out_norm is None:
                    for stack in (ffn.experts.w_down,
                                  None if ffn.shared is None else ffn.shared.w_down.weight):
                        if stack is not None:
                            stack.mul_(block.branch)
                else:
                    _scale_output(ffn.experts.w_down, ffn.down_out, ffn.out_norm, block.branch)
            else:
                _scale_output(ffn.w_down.weight, ffn.w_down.out_site, ffn.w_down.out_norm,
                              block.branch)
            block.branch = 1.0
        if isinstance(ffn, MoEFeedForward) and ffn.router_scale != 1:
            ffn.router.weight.mul_(ffn.router_scale)
            ffn.router_scale = 1.0
    folded.cfg = dataclasses.replace(folded.cfg, parameterization="sp", base_dim=None,
                                     base_layers=None, base_head_dim=None)
    folded.parameterization = Parameterization.of(folded.cfg)

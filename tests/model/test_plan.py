"""The scale plan is the model: for every strategy preset (configs/scale) on a dense and an MoE
model, the sites a built model has (path, shape, role, parameterization, behind a normalization or
not, and each parameter's optimizer group in the optimizer the trainer builds) are exactly the
plan's rows, in order; and the rows are the ones written out here by hand from
docs/concepts/scale-vectors.md (so that a changed rule fails: the plan cannot agree with the model
by construction and also with this table by accident). A folded model has exactly the sites of its
folded plan."""

import pytest
import torch

from scalevec_train.model import Transformer
from scalevec_train.model.fold import fold
from scalevec_train.model.strategies import scale_sites
from scalevec_train.optim.groups import build_optimizer
from tests.support.helpers import REPO, make_config
from tests.support.presets import SMALL_MODEL

PRESETS = sorted(p.stem for p in (REPO / "configs" / "scale").glob("*.yaml"))
# dim 64, 4 heads of 16, 2 KV heads (width 32), ffn 96
SMALL = [*SMALL_MODEL, "model.vocab_size=128"]
MOE = [*SMALL, "model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=16",
       "model.moe.num_shared_experts=1"]
MODELS = {"dense": SMALL, "moe": MOE}

# (block-relative path, shape, role, behind a normalization), per part of a block and per model.
PRE_NORM = {"shared": [("attn_norm.sites.attn", (64,), "input", False)],
            "per_branch": [(f"attn_norm.sites.{b}", (64,), "input", False) for b in "qkv"]}
FFN_NORM = {
    "dense": {"shared": [("ffn_norm.sites.ffn", (64,), "input", False)],
              "per_branch": [(f"ffn_norm.sites.{b}", (64,), "input", False)
                             for b in ("gate", "up")]},
    "moe": {"shared": [("ffn_norm.sites.ffn", (64,), "input", False)],
            "per_branch": [(f"ffn_norm.sites.{b}", (64,), "input", False)
                           for b in ("gate", "up", "router")]},
}
# dual (DP): an output site on q, k, v, gate, up (the pre-norm maps) of the map's output width;
# dual_norm (DNP): behind a normalization, per head of 16 for q, k, v
ATTN_OUT = {"pre": [],
            "dual": [("attn.wq.out_site", (64,), "output", False),
                     ("attn.wk.out_site", (32,), "output", False),
                     ("attn.wv.out_site", (32,), "output", False)],
            "dual_norm": [(f"attn.w{m}.out_site", (16,), "output", True) for m in "qkv"]}
FFN_OUT = {
    "dense": {"pre": [], **{placement: [("ffn.w_gate.out_site", (96,), "output", normed),
                                        ("ffn.w_up.out_site", (96,), "output", normed)]
                            for placement, normed in (("dual", False), ("dual_norm", True))}},
    # one row per routed expert (4 of 16 hidden units); the shared expert's hidden width is ffn_dim
    "moe": {"pre": [], **{placement: [("ffn.experts.gate_out", (4, 16), "output", normed),
                                      ("ffn.experts.up_out", (4, 16), "output", normed),
                                      ("ffn.shared.gate_out", (96,), "output", normed),
                                      ("ffn.shared.up_out", (96,), "output", normed)]
                          for placement, normed in (("dual", False), ("dual_norm", True))}},
}
FINAL = ("final_norm.sites.final", (64,), "input", False)
# preset: heterogeneity, placement, parameterization of every site, the roles whose sites decay
STRATEGIES = {
    "none": ("shared", "pre", "fixed", ()),
    "baseline": ("shared", "pre", "plain", ()),
    "iwd": ("shared", "pre", "plain", ("input",)),
    "wd_all": ("shared", "pre", "plain", ("input", "output")),
    "hg": ("per_branch", "pre", "plain", ()),
    "dp": ("shared", "dual", "plain", ()),
    "dnp": ("shared", "dual_norm", "plain", ()),
    "or": ("shared", "pre", "or", ()),
    "er": ("shared", "pre", "er", ()),
    "unified": ("per_branch", "dual_norm", "or", ("input",)),
}
# Decay in magnitude mode (the presets' default): the magnitude of a decayed site, never
# its direction.
GROUPS = {"fixed": {}, "plain": {"scale": "scale_decay"},
          "or": {"beta": "scale_decay", "alpha": "scale_no_decay"},
          "er": {"b": "scale_log_decay", "alpha": "scale_no_decay"}}


def expected_rows(kind: str, preset: str) -> list[tuple]:
    heterogeneity, placement, param, decaying = STRATEGIES[preset]
    block = (PRE_NORM[heterogeneity] + ATTN_OUT[placement] + FFN_NORM[kind][heterogeneity]
             + FFN_OUT[kind][placement])
    rows = [(f"layers.{i}.{path}", *rest) for i in range(2) for path, *rest in block] + [FINAL]
    out = []
    for path, shape, role, normed in rows:
        groups = {name: group if role in decaying else "scale_no_decay"
                  for name, group in GROUPS[param].items()}
        out.append((path, shape, role, param, normed, groups))
    return out


def build(kind: str, preset: str, *extra: str) -> tuple[Transformer, object]:
    cfg = make_config(*MODELS[kind], f"scale={preset}", *extra)
    return Transformer(cfg.model, cfg.scale), cfg


def model_rows(model: Transformer, optimizer: torch.optim.Optimizer) -> list[tuple]:
    """What the model has: its sites, with each parameter's group in `optimizer`."""
    group_of = {id(p): g["name"] for g in optimizer.param_groups for p in g["params"]}
    return [(path, site.shape, site.role, site.param, site.behind_norm,
             {n: group_of[id(p)] for n, p in site.named_parameters()})
            for path, site in scale_sites(model)]


def plan_rows(model: Transformer) -> list[tuple]:
    return [(row.path, row.shape, row.role, row.param, row.behind_norm,
             {p.name: p.group for p in row.params})
            for row in model.plan.rows]


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("preset", PRESETS)
def test_the_model_has_exactly_the_plans_sites(kind, preset):
    model, cfg = build(kind, preset)
    assert plan_rows(model) == model_rows(model, build_optimizer(model, cfg.optim))
    for row in model.plan.rows:  # each parameter's shape too
        site = model.get_submodule(row.path)
        assert ([(p.name, p.shape) for p in row.params]
                == [(n, tuple(t.shape)) for n, t in site.named_parameters()])
    assert plan_rows(model) == expected_rows(kind, preset)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("preset", ["baseline", "dp", "unified"])
def test_a_folded_model_has_exactly_its_folded_plans_sites(kind, preset):
    model, _ = build(kind, preset)
    model.init_weights(0)
    folded = fold(model)
    assert [(p, s.shape, s.role, s.param, s.behind_norm) for p, s in scale_sites(folded)] == [
        (r.path, r.shape, r.role, r.param, r.behind_norm) for r in folded.plan.rows]
    # what folds is fixed; a site behind a normalization stays, plain (its s kept)
    assert ({(r.param, r.behind_norm) for r in folded.plan.rows}
            <= {("fixed", False), ("plain", True)})
    assert [r.behind_norm for r in folded.plan.rows] == [r.behind_norm for r in model.plan.rows]


def test_decay_options_reach_the_rows():
    """scale.decay_final_norm=false spares the final norm's site; reparam_decay=all_params decays
    alpha too."""
    model, _ = build("dense", "unified", "scale.decay_final_norm=false")
    assert ({p.name: p.group for p in model.plan.final.params}
            == {"beta": "scale_no_decay", "alpha": "scale_no_decay"})
    model, _ = build("dense", "unified", "scale.reparam_decay=all_params")
    assert ({p.name: p.group for p in model.plan.rows[0].params}
            == {"beta": "scale_decay", "alpha": "scale_decay"})


def test_qkv_norm_full_normalizes_q_k_v_over_their_whole_outputs():
    """scale.qkv_norm=full: dual_norm's normalization behind q, k and v spans the map's whole output
    (one RMS per token, not one per head), its site as wide; u * N(W a) computed here by hand. The
    model's own QK-norm stays per head."""
    model, _ = build("dense", "unified", "scale.qkv_norm=full")
    attn = model.plan.blocks[0].attn
    assert [(p.out_norm, p.out_site.shape, p.out_site.norm.label)
            for p in (attn.q, attn.k, attn.v)] == [
        ("full", (64,), "N(q)"), ("full", (32,), "N(k)"), ("full", (32,), "N(v)")]
    assert model.plan.blocks[0].attn_norm.sites["q"].cancelled_by == "N(q)"
    model.init_weights(0)
    wk = model.layers[0].attn.wk
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        wk.out_site.alpha.copy_(1 + 0.3 * torch.randn(32, generator=gen))
        wk.out_site.beta.fill_(1.7)
    a = torch.randn(2, 5, 64, generator=gen)
    y = a @ wk.weight.T
    alpha = wk.out_site.alpha
    u = 1.7 * alpha / alpha.square().mean().sqrt()
    want = u * y / (y.square().mean(-1, keepdim=True) + model.cfg.norm_eps).sqrt()
    torch.testing.assert_close(wk(a), want)
    model, _ = build("dense", "unified", "scale.qkv_norm=full", "model.qk_norm=true")
    attn = model.plan.blocks[0].attn
    assert (attn.q.out_norm, attn.k.out_norm, attn.v.out_norm) == ("head", "head", "full")

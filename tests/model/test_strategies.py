"""Scale-vector strategies against the spec: identities at init, folding, gradients,
decay policy."""

import math

import pytest
import torch

from scalevec_train.model import Transformer
from scalevec_train.model.fold import fold
from scalevec_train.model.strategies import ScaleSite, scale_sites, site_display_name
from scalevec_train.optim.groups import build_optimizer, classify
from tests.support.helpers import make_config_shared
from tests.support.presets import SMALL_MODEL

PRESETS = ["none", "baseline", "iwd", "wd_all", "hg", "dp", "dnp", "or", "er", "unified"]
SMALL = [*SMALL_MODEL, "model.vocab_size=128"]


def build(scale: str, *extra: str, seed: int = 0) -> Transformer:
    cfg = make_config_shared(f"scale={scale}", *SMALL, *extra)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed)
    return model


def randomize_sites(model: Transformer, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, site in scale_sites(model):
            for name, p in site.named_parameters():
                noise = 0.5 * torch.randn(p.shape, generator=gen)
                p.copy_(noise if name == "b" else 1.0 + noise)


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scale", ["hg", "dp", "or", "er", "iwd", "none"])
def test_strategies_start_as_the_baseline_function(scale):
    x = tokens()
    assert torch.equal(build(scale)(x), build("baseline")(x))


def test_none_has_no_learnable_scale():
    model = build("none")
    assert all(site.param == "fixed" for _, site in scale_sites(model))
    assert sum(p.numel() for _, s in scale_sites(model) for p in s.parameters()) == 0


REV1 = "scale.targets=[q,k,o,down]"  # revision 1's placement reading


def layer0_sites(model: Transformer) -> dict[str, ScaleSite]:
    return {name: site for path, site in scale_sites(model)
            for layer, name in [site_display_name(path)] if layer == 0}


def test_unified_has_exactly_the_spec_sites():
    """Revision 2: HG input sites, and u * Norm(W .) on every pre-norm map; nothing on o or down."""
    model = build("unified")
    sites = layer0_sites(model)
    assert set(sites) == {
        "attn_norm.sites.q", "attn_norm.sites.k", "attn_norm.sites.v",  # HG input sites
        # q = u_q * N_h(Wq .), k and v likewise
        "attn.wq.out_site", "attn.wk.out_site", "attn.wv.out_site",
        "ffn_norm.sites.gate", "ffn_norm.sites.up",  # HG
        "ffn.w_gate.out_site", "ffn.w_up.out_site",  # gate = u_gate * N(W_gate .), up likewise
    }
    assert ({p for p, _ in scale_sites(model) if not p.startswith("layers.")}
            == {"final_norm.sites.final"})
    assert all(s.param == "or" for _, s in scale_sites(model))
    assert ({n for n, s in sites.items() if s.behind_norm}
            == {n for n in sites if n.endswith("out_site")})
    assert {n: s.shape for n, s in sites.items() if s.role == "output"} == {
        "attn.wq.out_site": (16,), "attn.wk.out_site": (16,), "attn.wv.out_site": (16,),  # head_dim
        "ffn.w_gate.out_site": (96,), "ffn.w_up.out_site": (96,)}  # ffn_dim
    assert all(s.shape == (64,) for s in sites.values() if s.role == "input")


def test_revision_1_reading_stays_available():
    """scale.targets=[q,k,o,down]: QK-norm plus Gemma-style post-norms with learnable scales."""
    sites = layer0_sites(build("unified", REV1))
    assert set(sites) == {
        "attn_norm.sites.q", "attn_norm.sites.k", "attn_norm.sites.v",
        "attn.wq.out_site", "attn.wk.out_site",  # u_q * N_h(Wq .), k likewise
        "attn.wo.in_site", "attn.wo.out_site",  # DP on o: v_o, and u_o behind N
        "ffn_norm.sites.gate", "ffn_norm.sites.up",
        "ffn.w_down.in_site", "ffn.w_down.out_site",  # DP on down
    }
    assert {n for n, s in sites.items() if s.behind_norm} == {
        "attn.wq.out_site", "attn.wk.out_site", "attn.wo.out_site", "ffn.w_down.out_site"}


def test_dp_places_output_sites_on_the_pre_norm_maps():
    """W -> diag(u) W diag(v) on q, k, v, gate, up, with v the pre-norm's own (shared) site."""
    sites = layer0_sites(build("dp"))
    assert set(sites) == {"attn_norm.sites.attn", "ffn_norm.sites.ffn", "attn.wq.out_site",
                          "attn.wk.out_site", "attn.wv.out_site", "ffn.w_gate.out_site",
                          "ffn.w_up.out_site"}
    assert not any(s.behind_norm for s in sites.values())
    assert sites["attn.wk.out_site"].shape == (32,) and sites["ffn.w_up.out_site"].shape == (96,)


def test_dnp_reuses_model_norms():
    """On a model with QK-norm and post-norms, dnp makes their scales sites; it adds no
    second norm."""
    gemma = ["model.qk_norm=true", "model.post_norm=true"]
    x = tokens()
    base = build("baseline", *gemma)
    base_norms = {p for p, s in scale_sites(base) if s.behind_norm}
    assert len(base_norms) == 2 * 4  # q, k, o, down in both layers
    # Revision 1's targets are exactly the model's own norms: only new input sites (at 1) on o and
    # down, so the same function at init.
    rev1 = build("dnp", REV1, *gemma)
    assert torch.equal(base(x), rev1(x))
    assert {p for p, s in scale_sites(rev1) if s.behind_norm} == base_norms
    # Revision 2 reuses QK-norm behind q and k and adds the norms behind v, gate and up.
    rev2 = build("dnp", *gemma)
    added = {site_display_name(p)[1] for p, s in scale_sites(rev2) if s.behind_norm} - {
        site_display_name(p)[1] for p in base_norms}
    assert added == {"attn.wv.out_site", "ffn.w_gate.out_site", "ffn.w_up.out_site"}


def test_dual_before_a_model_norm_is_refused():
    from scalevec_train.infra.errors import ScalevecError

    with pytest.raises(ScalevecError, match="dual_norm"):
        build("dp", "model.qk_norm=true")


@pytest.mark.parametrize("scale", PRESETS)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("reading", ["rev2", "rev1"])
def test_folding_preserves_logits(scale, gemma, reading):
    extra = (["model.qk_norm=true", "model.post_norm=true", "model.tie_embeddings=false"] if gemma
             else [])
    extra += [REV1] if reading == "rev1" else []
    if gemma and scale == "dp":
        # dual placement before the model's own QK-norm/post-norms is refused (tested below)
        extra = ([e for e in extra if e not in ("model.post_norm=true", REV1)]
                 + ["scale.targets=[v,o,gate]"])
    model = build(scale, *extra)
    randomize_sites(model)
    x = tokens(3)
    folded = fold(model)
    assert (folded(x) - model(x)).abs().max().item() <= 1e-5
    assert not [p for p, s in scale_sites(folded) if s.foldable]
    if scale in ("baseline", "none") and not gemma:
        # A folded baseline is a plain Llama: norms without learnable weights.
        assert all(s.param == "fixed" for _, s in scale_sites(folded))


MOE = ["model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=16",
       "model.moe.num_shared_experts=1"]


@pytest.mark.parametrize("scale", ["baseline", "hg", "dp", "dnp", "unified", "er"])
@pytest.mark.parametrize("reading", ["rev2", "rev1"])
def test_moe_folding_preserves_logits_and_maps_every_site_once(scale, reading):
    extra = [*MOE, "scale.per_expert=true"] if scale in ("hg", "unified") else MOE
    model = build(scale, *extra, *([REV1] if reading == "rev1" else []))
    randomize_sites(model)
    mapped = [m.site for m in model.site_maps()]
    assert len(mapped) == len(set(mapped)) and set(mapped) == {s for _, s in scale_sites(model)}
    x = tokens(4)
    folded = fold(model)
    assert (folded(x) - model(x)).abs().max().item() <= 1e-5
    assert not [p for p, s in scale_sites(folded) if s.foldable]


@pytest.mark.parametrize("param", ["or", "er"])
def test_reparam_gradients_match_closed_form(param):
    """s = m * alpha / rms(alpha): ds/dm and ds/dalpha against the closed form, in float64."""
    torch.manual_seed(0)
    site = ScaleSite((7,), "input", param).double()
    with torch.no_grad():
        site.alpha.copy_(1 + 0.5 * torch.randn(7, dtype=torch.float64))
        (site.beta if param == "or" else site.b).fill_(0.3)
    g = torch.randn(7, dtype=torch.float64)  # upstream gradient dL/ds
    (site() * g).sum().backward()
    a = site.alpha.detach()
    n = a.numel()
    rms = a.pow(2).mean().sqrt()
    mag = torch.tensor(0.3, dtype=torch.float64)
    mag = mag if param == "or" else mag.exp()
    direction = a / rms
    # d(a/rms)/da = I/rms - a a^T / (n rms^3)
    expected_alpha = mag * (g / rms - a * (a @ g) / (n * rms**3))
    expected_mag = (g * direction).sum() * (1.0 if param == "or" else mag)
    grad_mag = site.beta.grad if param == "or" else site.b.grad
    torch.testing.assert_close(site.alpha.grad, expected_alpha)
    torch.testing.assert_close(grad_mag.squeeze(), expected_mag)


def test_iwd_decays_exactly_the_input_sites_magnitudes():
    model = build("unified")  # iwd, with input and output sites, or-parameterized
    groups = classify(model)
    decayed = sorted(name for name, _ in groups["scale_decay"])
    # In magnitude mode an or site decays its beta only: alpha's norm does not change s.
    expected = sorted(f"{path}.beta" for path, site in scale_sites(model) if site.role == "input")
    assert decayed == expected
    assert "final_norm.sites.final.beta" in decayed and "layers.1.attn_norm.sites.q.beta" in decayed
    undecayed = {n for n, _ in groups["scale_no_decay"]}
    assert {"layers.1.attn_norm.sites.q.alpha", "layers.0.attn.wq.out_site.beta",
            "layers.0.attn.wq.out_site.alpha"} <= undecayed
    assert not groups["scale_log_decay"]
    # Revision 1's decay: every parameter of an input site.
    groups = classify(build("unified", "scale.reparam_decay=all_params"))
    assert sorted(n for n, _ in groups["scale_decay"]) == sorted(
        f"{path}.{p}" for path, site in scale_sites(model) if site.role == "input"
        for p in ("beta", "alpha"))


def test_weight_decay_policies_all_and_none():
    for scale, kind in (("wd_all", "scale_decay"), ("baseline", "scale_no_decay")):
        model = build(scale)
        groups = classify(model)
        n_scale = sum(1 for _, s in scale_sites(model) for _ in s.parameters())
        assert len(groups[kind]) == n_scale


LR, WD = 0.01, 0.5


def one_step(reparam: str, optim: str, decay: str, zero_grads: bool):
    """A unified model under scale.reparam=`reparam`, after one optimizer step from random sites
    with random (or zero) gradients: (sites before, their gradients, the model after)."""
    cfg = make_config_shared("scale=unified", f"scale.reparam={reparam}",
                             f"scale.reparam_decay={decay}", *SMALL, f"optim={optim}",
                             f"optim.lr={LR}", f"optim.weight_decay={WD}")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    randomize_sites(model)
    gen = torch.Generator().manual_seed(2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if zero_grads else torch.randn(p.shape, generator=gen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg.optim)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"]
    optimizer.step()
    return cfg, before, grads, model


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("reparam", ["or", "er", "plain"])
def test_decay_shrinks_s_by_the_decoupled_factor(reparam, optim):
    """With no gradient, one step multiplies the s of every decayed (input) site by exactly
    1 - lr*wd and leaves output sites alone, whatever the parameterization (spec revision 2,
    in s-space)."""
    _, before, _, model = one_step(reparam, optim, "magnitude", zero_grads=True)
    for path, site in scale_sites(model):
        s_after = site().detach().clone()
        for name, p in site.named_parameters():
            p.data.copy_(before[f"{path}.{name}"])
        expected = site().detach() * ((1 - LR * WD) if site.role == "input" else 1.0)
        torch.testing.assert_close(s_after, expected, rtol=1e-6, atol=0, msg=path)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("decay", ["magnitude", "all_params"])
@pytest.mark.parametrize("reparam", ["or", "er"])
def test_one_step_of_a_reparameterized_site_matches_the_closed_form(reparam, decay, optim):
    """Adam's first step moves every parameter by lr * g / (|g| + eps); decay comes on top: in
    magnitude mode beta <- beta (1 - lr wd), b <- b + log(1 - lr wd), alpha undecayed; in all_params
    mode every parameter of the site p <- p (1 - lr wd) (revision 1). Output sites never decay
    under iwd."""
    cfg, before, grads, model = one_step(reparam, optim, decay, zero_grads=False)
    eps = cfg.optim.eps
    for path, site in scale_sites(model):
        for name, p in site.named_parameters():
            key = f"{path}.{name}"
            x0, g = before[key].double(), grads[key].double()
            if site.role != "input":
                decayed = x0
            elif decay == "all_params":
                decayed = x0 * (1 - LR * WD)
            elif name == "beta":
                decayed = x0 * (1 - LR * WD)
            elif name == "b":
                decayed = x0 + math.log(1 - LR * WD)
            else:
                decayed = x0
            expected = decayed - LR * g / (g.abs() + eps)
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("scale", PRESETS)
def test_scale_parameters_are_a_tiny_share_on_0_12b(scale):
    cfg = make_config_shared("model=dense-0.12b", f"scale={scale}")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    total = sum(p.numel() for p in model.parameters())
    scale_params = sum(p.numel() for _, s in scale_sites(model) for p in s.parameters())
    assert scale_params / total < 0.005


def test_axes_override_on_top_of_a_preset():
    cfg = make_config_shared("scale=unified", "scale.reparam=er", *SMALL)
    model = Transformer(cfg.model, cfg.scale)
    assert {s.param for _, s in scale_sites(model)} == {"er"}
    cfg = make_config_shared("scale=unified", "scale.reparam_sites=input", *SMALL)
    model = Transformer(cfg.model, cfg.scale)
    assert {s.param for _, s in scale_sites(model) if s.role == "output"} == {"plain"}

"""Scale-vector strategies against the spec: identities at init, folding, gradients, decay policy."""

import pytest
import torch

from scalevec_train.fold import fold
from scalevec_train.model import Transformer
from scalevec_train.optim import classify
from scalevec_train.strategies import ScaleSite, scale_sites, site_display_name
from tests.helpers import make_config

PRESETS = ["none", "baseline", "iwd", "wd_all", "hg", "dp", "dnp", "or", "er", "unified"]
SMALL = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96", "model.n_layers=2",
         "model.vocab_size=128"]


def build(scale: str, *extra: str, seed: int = 0) -> Transformer:
    cfg = make_config(f"scale={scale}", *SMALL, *extra)
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


def test_unified_has_exactly_the_spec_sites():
    model = build("unified")
    per_layer = {name for path, _ in scale_sites(model) for layer, name in [site_display_name(path)]
                 if layer == 0}
    assert per_layer == {
        "attn_norm.sites.q", "attn_norm.sites.k", "attn_norm.sites.v",  # HG input sites
        "attn.wq.out_site", "attn.wk.out_site",  # DNP: q = u_q * N_h(Wq .), k likewise
        "attn.wo.in_site", "attn.wo.out_site",  # DP on o: v_o, and u_o behind N
        "ffn_norm.sites.gate", "ffn_norm.sites.up",  # HG
        "ffn.w_down.in_site", "ffn.w_down.out_site",  # DP on down
    }
    sites = dict(scale_sites(model))
    assert {p for p, _ in scale_sites(model) if not p.startswith("layers.")} == {"final_norm.sites.final"}
    assert all(s.param == "or" for s in sites.values())
    behind = {site_display_name(p)[1] for p, s in sites.items() if s.behind_norm}
    assert behind == {"attn.wq.out_site", "attn.wk.out_site", "attn.wo.out_site", "ffn.w_down.out_site"}
    assert sites["layers.0.attn.wq.out_site"].shape == (16,)  # head_dim, shared by heads


def test_dnp_reuses_model_norms():
    """On a model with QK-norm and post-norms, dnp makes their scales sites; it adds no second norm."""
    gemma = ["model.qk_norm=true", "model.post_norm=true"]
    base, dnp = build("baseline", *gemma), build("dnp", *gemma)
    x = tokens()
    # Same normalizations, only new input sites (at 1) on o and down: the same function at init.
    assert torch.equal(base(x), dnp(x))
    base_norms = {p for p, s in scale_sites(base) if s.behind_norm}
    dnp_norms = {p for p, s in scale_sites(dnp) if s.behind_norm}
    assert base_norms == dnp_norms and len(base_norms) == 2 * 4


def test_dual_before_a_model_norm_is_refused():
    from scalevec_train.errors import ScalevecError

    with pytest.raises(ScalevecError, match="dual_norm"):
        build("dp", "model.qk_norm=true")


@pytest.mark.parametrize("scale", PRESETS)
@pytest.mark.parametrize("gemma", [False, True])
def test_folding_preserves_logits(scale, gemma):
    extra = ["model.qk_norm=true", "model.post_norm=true", "model.tie_embeddings=false"] if gemma else []
    if gemma and scale == "dp":
        extra.append("scale.targets=[v,o]")
        extra = [e for e in extra if e != "model.post_norm=true"]
    model = build(scale, *extra)
    randomize_sites(model)
    x = tokens(3)
    folded = fold(model)
    assert (folded(x) - model(x)).abs().max().item() <= 1e-5
    assert not [p for p, s in scale_sites(folded) if s.foldable]
    if scale in ("baseline", "none") and not gemma:
        # A folded baseline is a plain Llama: norms without learnable weights.
        assert all(s.param == "fixed" for _, s in scale_sites(folded))


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


def test_iwd_decays_exactly_the_input_sites():
    model = build("unified")  # iwd, with input and output sites, or-parameterized
    groups = classify(model, make_config("scale=unified", *SMALL).scale)
    decayed = sorted(name for name, _ in groups["scale_decay"])
    expected = sorted(f"{path}.{pname}" for path, site in scale_sites(model) if site.role == "input"
                      for pname, _ in site.named_parameters())
    assert decayed == expected
    assert "final_norm.sites.final.beta" in decayed and "layers.1.attn_norm.sites.q.alpha" in decayed
    assert "layers.0.attn.wq.out_site.alpha" in {n for n, _ in groups["scale_no_decay"]}


def test_weight_decay_policies_all_and_none():
    for scale, kind in (("wd_all", "scale_decay"), ("baseline", "scale_no_decay")):
        model = build(scale)
        groups = classify(model, make_config(f"scale={scale}", *SMALL).scale)
        n_scale = sum(1 for _, s in scale_sites(model) for _ in s.parameters())
        assert len(groups[kind]) == n_scale


@pytest.mark.parametrize("scale", PRESETS)
def test_scale_parameters_are_a_tiny_share_on_0_12b(scale):
    cfg = make_config("model=dense-0.12b", f"scale={scale}")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    total = sum(p.numel() for p in model.parameters())
    scale_params = sum(p.numel() for _, s in scale_sites(model) for p in s.parameters())
    assert scale_params / total < 0.005


def test_axes_override_on_top_of_a_preset():
    cfg = make_config("scale=unified", "scale.reparam=er", *SMALL)
    model = Transformer(cfg.model, cfg.scale)
    assert {s.param for _, s in scale_sites(model)} == {"er"}
    cfg = make_config("scale=unified", "scale.reparam_sites=input", *SMALL)
    model = Transformer(cfg.model, cfg.scale)
    assert {s.param for _, s in scale_sites(model) if s.role == "output"} == {"plain"}

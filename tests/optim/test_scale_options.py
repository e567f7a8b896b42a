"""The per-site optimizer settings: optim.scale_lr (the peak LR of every scale-site parameter),
optim.scale_weight_decay (the decay rate of the decayed ones) and scale.decay_final_norm (whether
decay reaches the final norm's site), and that their defaults give today's runs bit for bit.

Expectations are written here: Adam's first step moves every parameter by lr * g / (|g| + eps),
about lr; with no gradient a step only decays, p <- p (1 - lr wd) (b <- b + log(1 - lr wd) for an
`er` magnitude); the decayed sites of a 2-layer dense model under `unified` are listed by hand.
"""

import math

import pytest
import torch

from scalevec_train.checkpoint.files import read_train_state
from scalevec_train.checkpoint.manager import CheckpointManager, ModelState, OptimizerState
from scalevec_train.model import Transformer
from scalevec_train.model.strategies import scale_sites
from scalevec_train.optim.groups import build_optimizer, classify
from scalevec_train.optim.schedules import lr_multiplier
from scalevec_train.run.branch import shared_steps
from tests.support.helpers import make_config_shared
from tests.support.presets import TINY_MODEL

SMALL = [*TINY_MODEL, "model.vocab_size=64"]  # dense, 2 layers, tied head
LR, ADAMW_LR, SCALE_LR, WD, SCALE_WD = 1e-2, 4e-3, 1e-3, 0.5, 2.0
# (optimizer overrides, the peak LR every AdamW group but the scale sites' takes)
OPTIMIZERS = {"adamw": (["optim=adamw"], LR), "muon": (["optim=muon"], LR),
              "muon-adamw_lr": (["optim=muon", f"optim.adamw_lr={ADAMW_LR}"], ADAMW_LR)}


def built(*overrides: str, lr: float = LR):
    """A model with random parameters everywhere (so that decay and steps show on every entry) and
    the optimizer the trainer builds for it."""
    cfg = make_config_shared(*SMALL, f"optim.lr={lr}", *overrides)
    model = Transformer(cfg.model, cfg.scale)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return cfg, model, build_optimizer(model, cfg.optim)


def step(model, optimizer, multiplier: float, zero_grads: bool) -> dict[str, torch.Tensor]:
    """One optimizer step at the schedule's `multiplier` (set as the trainer sets it); the
    parameters before."""
    gen = torch.Generator().manual_seed(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if zero_grads else torch.randn(p.shape, generator=gen)
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * multiplier
    optimizer.step()
    return before


def site_params(model) -> dict[str, tuple]:
    """parameter name -> (site path, site, its name in the site) for every scale-site parameter."""
    return {f"{path}.{name}": (path, site, name) for path, site in scale_sites(model)
            for name, _ in site.named_parameters()}


@pytest.mark.parametrize("reparam", ["plain", "or", "er"])
@pytest.mark.parametrize("scale_lr", [None, SCALE_LR])
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_scale_lr_sets_the_first_step_of_every_scale_parameter(optim, scale_lr, reparam):
    """Adam's first step moves each scale parameter by about scale_lr times the schedule's
    multiplier (null: the other AdamW groups' LR); the embedding and the matrices keep their own
    steps."""
    overrides, adamw_lr = OPTIMIZERS[optim]
    options = [*overrides, "scale=unified", f"scale.reparam={reparam}", "optim.weight_decay=0"]
    chosen = [] if scale_lr is None else [f"optim.scale_lr={scale_lr}"]
    _, model, optimizer = built(*options, *chosen)
    multiplier = 0.5
    before = step(model, optimizer, multiplier, zero_grads=False)
    after = dict(model.named_parameters())
    sites = site_params(model)
    expected_site_step = multiplier * (adamw_lr if scale_lr is None else scale_lr)
    for name in sites:
        moved = (after[name].detach() - before[name]).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, expected_site_step), rtol=1e-3,
                                   atol=0, msg=name)
    moved = (after["tok_emb.weight"].detach() - before["tok_emb.weight"]).abs()
    torch.testing.assert_close(moved, torch.full_like(moved, multiplier * adamw_lr), rtol=1e-3,
                               atol=0)
    matrices = [n for n in after if n not in sites and n != "tok_emb.weight"]
    assert matrices and all(".w" in n for n in matrices)
    if optim == "adamw":
        for name in matrices:
            moved = (after[name].detach() - before[name]).abs()
            torch.testing.assert_close(moved, torch.full_like(moved, multiplier * LR), rtol=1e-3,
                                       atol=0, msg=name)
    else:  # Muon's matrices take the same step whatever the scale sites' LR: against another one's
        other = [f"optim.scale_lr={SCALE_LR}"] if scale_lr is None else []
        _, reference, reference_optimizer = built(*options, *other)
        step(reference, reference_optimizer, multiplier, zero_grads=False)
        expected = dict(reference.named_parameters())
        for name in matrices:
            assert torch.equal(after[name], expected[name]), name


@pytest.mark.parametrize("reparam", ["plain", "or", "er"])
@pytest.mark.parametrize("scale_lr", [None, SCALE_LR])
@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_scale_weight_decay_sets_the_decay_of_the_decayed_sites(optim, scale_lr, reparam):
    """With no gradient a step only decays: under unified (IWD, magnitude mode) each input site's
    magnitude shrinks by 1 - lr_site * scale_weight_decay (an `er` one's b shifts by its log), alpha
    and the output sites stay; the matrices decay by 1 - lr * weight_decay."""
    overrides, adamw_lr = OPTIMIZERS[optim]
    chosen = [] if scale_lr is None else [f"optim.scale_lr={scale_lr}"]
    _, model, optimizer = built(*overrides, "scale=unified", f"scale.reparam={reparam}",
                                f"optim.weight_decay={WD}", f"optim.scale_weight_decay={SCALE_WD}",
                                *chosen)
    multiplier = 0.5
    before = step(model, optimizer, multiplier, zero_grads=True)
    after = dict(model.named_parameters())
    shrink = 1 - multiplier * (adamw_lr if scale_lr is None else scale_lr) * SCALE_WD
    sites = site_params(model)
    for name, (_, site, part) in sites.items():
        x0 = before[name].double()
        if site.role != "input" or part == "alpha":
            expected = x0
        elif part == "b":
            expected = x0 + math.log(shrink)
        else:
            expected = x0 * shrink
        torch.testing.assert_close(after[name].detach().double(), expected, rtol=1e-6, atol=1e-7,
                                   msg=name)
    for name in after:
        # the embedding does not decay (decay_embeddings)
        if name not in sites and name != "tok_emb.weight":
            expected = before[name] * (1 - multiplier * LR * WD)
            torch.testing.assert_close(after[name].detach(), expected, rtol=1e-6, atol=0, msg=name)


# The decayed parameters of SMALL under unified (HG + DNP + OR + IWD) in magnitude mode: the
# magnitude of every input site (the branch sites of both pre-norms of both layers, and the final
# norm's).
BRANCH_MAGNITUDES = [f"layers.{layer}.{norm}.sites.{branch}.beta" for layer in (0, 1)
                     for norm, branch in [("attn_norm", "q"), ("attn_norm", "k"),
                                          ("attn_norm", "v"), ("ffn_norm", "gate"),
                                          ("ffn_norm", "up")]]


@pytest.mark.parametrize("decay_final_norm,expected", [
    ("true", [*BRANCH_MAGNITUDES, "final_norm.sites.final.beta"]),
    ("false", BRANCH_MAGNITUDES),
])
def test_decay_final_norm_decides_whether_the_final_norms_site_decays(decay_final_norm, expected):
    cfg = make_config_shared(*SMALL, "scale=unified", f"scale.decay_final_norm={decay_final_norm}")
    groups = classify(Transformer(cfg.model, cfg.scale))
    assert sorted(n for n, _ in groups["scale_decay"]) == sorted(expected)
    # ... and in the optimizer: with no gradient the final site's magnitude shrinks only when it
    # decays
    _, model, optimizer = built("scale=unified", f"scale.decay_final_norm={decay_final_norm}",
                                f"optim.weight_decay={WD}")
    before = step(model, optimizer, 1.0, zero_grads=True)
    beta = model.final_norm.sites["final"].beta.detach()
    shrink = (1 - LR * WD) if decay_final_norm == "true" else 1.0
    torch.testing.assert_close(beta, before["final_norm.sites.final.beta"] * shrink, rtol=1e-6,
                               atol=0)


def test_decay_final_norm_keeps_the_final_site_of_every_policy_undecayed():
    """wd_all decays every site but, with decay_final_norm=false, the final norm's."""
    cfg = make_config_shared(*SMALL, "scale=wd_all", "scale.decay_final_norm=false")
    groups = classify(Transformer(cfg.model, cfg.scale))
    assert [n for n, _ in groups["scale_no_decay"]] == ["final_norm.sites.final.scale"]
    assert sorted(n for n, _ in groups["scale_decay"]) == sorted(
        f"layers.{layer}.{norm}_norm.sites.{norm}.scale" for layer in (0, 1)
        for norm in ("attn", "ffn"))


# What the defaults equal today: the scale sites follow adamw_lr under Muon (else lr) and
# weight_decay, the final norm's site decays, decay acts on the magnitude.
EXPLICIT_DEFAULTS = ["optim.scale_weight_decay=0.1", "scale.decay_final_norm=true",
                     "scale.reparam_decay=magnitude"]


def train(*overrides: str, steps: int = 4) -> dict[str, torch.Tensor]:
    """The parameters after `steps` steps of next-token training on fixed random tokens, the
    schedule's multiplier applied as the trainer applies it."""
    cfg = make_config_shared(*SMALL, "optim.weight_decay=0.1", f"train.steps={steps}",
                             "schedule.warmup_steps=2", *overrides)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, cfg.model.vocab_size, (steps, 4, 17),
                           generator=torch.Generator().manual_seed(0))
    for i in range(steps):
        logits = model(tokens[i, :, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[i, :, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_multiplier(cfg.schedule, i, steps)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("scale", [["scale=baseline"], ["scale=unified"],
                                   ["scale=unified", "scale.reparam=er"]])
@pytest.mark.parametrize("optim,today", [(["optim=adamw"], LR), (["optim=muon"], LR),
                                         (["optim=muon", f"optim.adamw_lr={ADAMW_LR}"], ADAMW_LR)])
def test_defaults_are_the_values_that_equal_todays_bit_for_bit(scale, optim, today):
    default = train(*scale, *optim, f"optim.lr={LR}")
    explicit = train(*scale, *optim, f"optim.lr={LR}", f"optim.scale_lr={today}",
                     *EXPLICIT_DEFAULTS)
    assert default.keys() == explicit.keys()
    for name in default:
        assert torch.equal(default[name], explicit[name]), name
    moved = train(*scale, *optim, f"optim.lr={LR}", f"optim.scale_lr={today / 2}")  # a change shows
    assert any(not torch.equal(default[name], moved[name]) for name in default)


WSD = ["schedule=wsd", "schedule.warmup_steps=2", "schedule.decay_fraction=0.5", "train.steps=20"]


@pytest.mark.parametrize("trunk,branch,shared", [
    ([], [f"optim.scale_lr={LR}"], 20),  # the value null stands for: the same LRs
    ([], [f"optim.scale_lr={SCALE_LR}"], 0),
    ([f"optim.scale_lr={SCALE_LR}"], [f"optim.scale_lr={SCALE_LR}"], 20),
    (["optim=muon", f"optim.adamw_lr={ADAMW_LR}"], ["optim=muon", f"optim.adamw_lr={ADAMW_LR}",
                                                    f"optim.scale_lr={ADAMW_LR}"], 20),
    (["optim=muon", f"optim.adamw_lr={ADAMW_LR}"], ["optim=muon", f"optim.adamw_lr={ADAMW_LR}",
                                                    f"optim.scale_lr={LR}"], 0),
])
def test_a_branch_must_share_its_trunks_scale_lr(trunk, branch, shared):
    """branch_from's check: a branch with another peak LR for the scale sites leaves the trunk at
    step 0."""
    trunk_cfg = make_config_shared(*SMALL, *WSD, f"optim.lr={LR}", *trunk)
    branch_cfg = make_config_shared(*SMALL, *WSD, f"optim.lr={LR}", *branch)
    assert shared_steps(trunk_cfg, branch_cfg, 20) == shared


def checkpoints(run_dir, model, optimizer) -> CheckpointManager:
    return CheckpointManager(run_dir, tensors={"model": ModelState(model),
                                               "optim": OptimizerState(model, optimizer)},
                             records={}, info={}, keep_last=1)


def test_a_resumed_run_takes_its_configs_scale_lr_and_decay(tmp_path):
    """A checkpoint restores the optimizer's state, not its settings: resumed with other scale_lr
    and scale_weight_decay (or a lowered lr, the stability guard's advice), the run steps with
    those."""
    _, model, optimizer = built("scale=unified", f"optim.weight_decay={WD}")
    step(model, optimizer, 1.0, zero_grads=False)
    saved = checkpoints(tmp_path, model, optimizer).save(1)

    _, model, optimizer = built("scale=unified", f"optim.weight_decay={WD}",
                                f"optim.scale_lr={SCALE_LR}",
                                f"optim.scale_weight_decay={SCALE_WD}", lr=LR / 2)
    checkpoints(tmp_path, model, optimizer).load(saved, read_train_state(saved))
    assert optimizer.state  # the moments came back
    settings = {g["name"]: (g["base_lr"], g["weight_decay"]) for g in optimizer.param_groups}
    assert settings == {"matrix": (LR / 2, WD), "embedding": (LR / 2, 0.0),
                        "scale_decay": (SCALE_LR, SCALE_WD), "scale_no_decay": (SCALE_LR, 0.0)}

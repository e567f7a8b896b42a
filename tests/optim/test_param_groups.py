"""Every parameter gets the learning rate, weight decay, decay rule and optimizer its config gives
it.

The expectation comes from a table written here from the documented options (configs/optim/*.yaml,
OptimConfig, ScaleConfig), not from the grouping code: which parameters are hidden matrices, the
router, the embedding, the head, and which scale site (with its role) each site parameter belongs
to. The check is behavioural: two optimizer steps of the optimizer the trainer builds, on random
gradients, against torch.optim.AdamW / torch.optim.Muon stepping each parameter alone with the
table's values.
"""

import math

import pytest
import torch

from scalevec_train.model import Transformer
from scalevec_train.optim.groups import build_optimizer
from tests.support.helpers import make_config

# moe-tiny shrunk, one layer, untied head, under scale=unified (HG + DNP + IWD): sites of both
# roles.
SMALL = ["model=moe-tiny", "model.dim=16", "model.n_heads=2", "model.n_kv_heads=1",
         "model.n_layers=1", "model.ffn_dim=16", "model.moe.num_experts=2",
         "model.moe.expert_dim=8", "model.vocab_size=32", "model.tie_embeddings=false",
         "scale=unified"]
EMBEDDING, HEAD, ROUTER = "tok_emb.weight", "head.weight", "layers.0.ffn.router.weight"
MATRICES = ["layers.0.attn.wq.weight", "layers.0.attn.wk.weight", "layers.0.attn.wv.weight",
            "layers.0.attn.wo.weight", "layers.0.ffn.experts.w_gate", "layers.0.ffn.experts.w_up",
            "layers.0.ffn.experts.w_down", "layers.0.ffn.shared.w_gate.weight",
            "layers.0.ffn.shared.w_up.weight", "layers.0.ffn.shared.w_down.weight"]
SITES = {  # site -> role: input (right before a linear map) or output
    "layers.0.attn_norm.sites.q": "input", "layers.0.attn_norm.sites.k": "input",
    "layers.0.attn_norm.sites.v": "input", "layers.0.ffn_norm.sites.gate": "input",
    "layers.0.ffn_norm.sites.up": "input", "layers.0.ffn_norm.sites.router": "input",
    "final_norm.sites.final": "input",
    "layers.0.attn.wq.out_site": "output", "layers.0.attn.wk.out_site": "output",
    "layers.0.attn.wv.out_site": "output", "layers.0.ffn.experts.gate_out": "output",
    "layers.0.ffn.experts.up_out": "output", "layers.0.ffn.shared.gate_out": "output",
    "layers.0.ffn.shared.up_out": "output",
}
PARTS = {"plain": ("scale",), "or": ("beta", "alpha"), "er": ("b", "alpha")}
# scale.weight_decay: the roles whose sites decay
DECAYING_ROLES = {"none": (), "iwd": ("input",), "all": ("input", "output")}
# scale.reparam_decay: what decay does to each part of a decaying site. scale: p <- p (1 - lr wd);
# log: b <- b + log(1 - lr wd) (exp(b) shrinks by the same factor); none: no decay.
DECAY_RULES = {"magnitude": {"scale": "scale", "beta": "scale", "b": "log", "alpha": "none"},
               "all_params": {"scale": "scale", "beta": "scale", "b": "scale", "alpha": "scale"}}
LR, WD, ADAMW_LR = 1e-2, 0.5, 4e-3  # lr * wd large enough that any missing or extra decay shows
CASES = {
    "adamw-plain-none": ["optim=adamw", "scale.reparam=plain", "scale.weight_decay=none"],
    "adamw-or-iwd-magnitude": ["optim=adamw", "scale.reparam=or"],
    "adamw-er-all-magnitude-decay_embeddings-no_decay_head": [
        "optim=adamw", "scale.reparam=er", "scale.weight_decay=all", "optim.decay_embeddings=true",
        "optim.decay_head=false"],
    "adamw-er-iwd-all_params": ["optim=adamw", "scale.reparam=er",
                                "scale.reparam_decay=all_params"],
    "muon-or-all-all_params-adamw_lr": ["optim=muon", "scale.reparam=or", "scale.weight_decay=all",
                                        "scale.reparam_decay=all_params",
                                        f"optim.adamw_lr={ADAMW_LR}"],
    "muon-er-iwd-magnitude-muon_router-decay_embeddings": [
        "optim=muon", "scale.reparam=er", "optim.muon_router=true", "optim.decay_embeddings=true"],
    "muon-plain-all-no_decay_head-adamw_lr": ["optim=muon", "scale.reparam=plain",
                                              "scale.weight_decay=all", "optim.decay_head=false",
                                              f"optim.adamw_lr={ADAMW_LR}"],
}


def option(overrides: list[str], key: str, default: str) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), default)


def expected_table(overrides: list[str]) -> dict[str, tuple[str, float, float, str]]:
    """parameter name -> (optimizer, peak lr, weight decay, decay rule), from the options alone."""
    muon = option(overrides, "optim", "adamw") == "muon"
    adamw_lr = float(option(overrides, "optim.adamw_lr", str(LR))) if muon else LR
    decay_embeddings = option(overrides, "optim.decay_embeddings", "false") == "true"
    decay_head = option(overrides, "optim.decay_head", "true") == "true"
    muon_router = option(overrides, "optim.muon_router", "false") == "true"
    roles = DECAYING_ROLES[option(overrides, "scale.weight_decay", "iwd")]  # iwd: unified's policy
    rules = DECAY_RULES[option(overrides, "scale.reparam_decay", "magnitude")]
    parts = PARTS[option(overrides, "scale.reparam", "or")]

    table = {name: ("muon" if muon else "adamw", LR, WD, "scale") for name in MATRICES}
    table[ROUTER] = (("muon", LR, WD, "scale") if muon and muon_router
                     else ("adamw", adamw_lr, WD, "scale"))
    table[EMBEDDING] = ("adamw", adamw_lr, WD if decay_embeddings else 0.0,
                        "scale" if decay_embeddings else "none")
    table[HEAD] = ("adamw", adamw_lr, WD if decay_head else 0.0, "scale" if decay_head else "none")
    for site, role in SITES.items():
        for part in parts:
            rule = rules[part] if role in roles else "none"
            table[f"{site}.{part}"] = ("adamw", adamw_lr, 0.0 if rule == "none" else WD, rule)
    return table


def reference_step(p: torch.Tensor, grads: list[torch.Tensor], kind: str, lr: float, wd: float,
                   rule: str) -> torch.Tensor:
    """`p` after the steps of torch's own optimizer with these values; a 3-D expert stack is a batch
    of matrices, each its own Muon matrix."""
    if kind == "muon" and p.ndim == 3:
        return torch.stack([reference_step(p[e], [g[e] for g in grads], kind, lr, wd, rule)
                            for e in range(len(p))])
    x = p.detach().clone().requires_grad_()
    decay = wd if rule == "scale" else 0.0
    if kind == "muon":
        opt = torch.optim.Muon([x], lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw")
    else:
        opt = torch.optim.AdamW([x], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=decay)
    for g in grads:
        if rule == "log":
            with torch.no_grad():
                x.add_(math.log(1 - lr * wd))
        x.grad = g.clone()
        opt.step()
    return x.detach()


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_gets_its_configured_lr_decay_and_optimizer(case):
    overrides = CASES[case]
    cfg = make_config(*SMALL, *overrides, f"optim.lr={LR}", f"optim.weight_decay={WD}")
    model = Transformer(cfg.model, cfg.scale)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random values everywhere: decay is visible on every parameter
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    table = expected_table(overrides)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(table)

    optimizer = build_optimizer(model, cfg.optim)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in before}
    multiplier = 0.5  # the schedule's, which the trainer applies to every group's peak LR
    for _ in range(2):
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * multiplier
        for n, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=gen)
            grads[n].append(p.grad.clone())
        optimizer.step()

    for name, p in model.named_parameters():
        kind, lr, wd, rule = table[name]
        expected = reference_step(before[name], grads[name], kind, lr * multiplier, wd, rule)
        # fp32 roundings of the same update in another order; a wrong LR, decay or optimizer moves a
        # parameter by about lr * wd = 5e-3 or lr = 1e-2. bf16 Newton-Schulz of a batch of expert
        # matrices rounds differently from one matrix at a time: up to a bf16 ulp of the update.
        atol = 2e-4 if kind == "muon" and p.ndim == 3 else 1e-6
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n} {table[n]}: {m}")

"""model.parameterization=mup (docs/concepts/parameterization.md): every multiplier against a table
written here from the rules' sources, the forward against a plain sp model with its weights scaled
by hand, and mup at its own base shape against sp bit for bit."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.config import compose_config
from scalevec_train.costs.tables import describe
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model import Transformer
from scalevec_train.model.config import ModelConfig, MoEConfig, ScaleConfig, architecture_diff
from scalevec_train.optim.config import OptimConfig
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.presets import TINY_MODEL, TINY_MOE

# m_N = 128 / 32 = 4, m_L = 4 / 2 = 2, head_dim 32 (4 heads) against a base head width of 8
SHAPE = ["model.dim=128", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=256",
         "model.n_layers=4", "model.vocab_size=512"]
MUP = ["model.parameterization=mup", "model.base_dim=32", "model.base_layers=2",
       "model.base_head_dim=8"]
SIGMA, LR, WD, EPS = 0.02, 0.01, 0.1, 1e-8


def expected(kind: str, name: str, optim: str, lr_adjust: str = "match_rms_adamw") -> dict:
    """Tensor Programs V's Adam rule (multiplier form), CompleteP at alpha = 1, and for Muon the
    spectral condition, written out for m_N = 4, m_L = 2
    (docs/concepts/parameterization.md's table)."""
    writes_residual = name.endswith(("wo.weight", "w_down.weight")) or ".experts.w_down" in name
    if kind == "hidden":
        # / sqrt(m_N), / sqrt(2 base_layers)
        init = SIGMA / 2 / (math.sqrt(2 * 2) if writes_residual else 1)
        forward = 0.5 if writes_residual else 1.0  # the residual branch's 1 / m_L
        if optim == "muon":
            lr_mult = 1.0 if lr_adjust == "original" else 0.5  # 1 / sqrt(m_N)
            return dict(init_std=init, lr=LR * lr_mult, weight_decay=WD / lr_mult, eps=None,
                        forward=forward)
        return dict(init_std=init, lr=LR / 4, weight_decay=WD * 4, eps=EPS / 8, forward=forward)
    # the embedding (decayed only with decay_embeddings) and the readouts: LR as at the
    # base, eps / m_N
    decay = 0.0 if kind == "embedding" else WD
    return dict(init_std=SIGMA, lr=LR, weight_decay=decay, eps=EPS / 4,
                forward=0.25 if kind == "readout" else 1.0)


@pytest.mark.parametrize("optim,lr_adjust",
                         [("adamw", None), ("muon", "match_rms_adamw"), ("muon", "original")])
def test_every_parameter_gets_its_rules_multipliers(optim, lr_adjust):
    extra = [f"optim.lr_adjust={lr_adjust}"] if lr_adjust else []
    cfg = compose_config([*TINY_MOE, *SHAPE, *MUP, "model.moe.expert_dim=64",
                          "model.moe.num_shared_experts=1", "scale=unified", f"optim={optim}",
                          f"optim.lr={LR}", *extra])
    d = describe(cfg)
    m = d["parameterization"]
    assert (m["width_multiplier"], m["depth_multiplier"], m["logits"], m["router_logits"],
            m["residual_branches"]) \
        == (4, 2, 0.25, 0.25, 0.5)
    assert m["attention_scale"] == pytest.approx(math.sqrt(8) / 32)
    kinds = {}
    for row in d["parameters"]:
        name = row["name"]
        kind = ("embedding" if name == "tok_emb.weight"
                else "readout" if name.endswith("router.weight") else "hidden")
        kinds[kind] = kinds.get(kind, 0) + 1
        want = expected(kind, name, optim if kind == "hidden" else "adamw", lr_adjust or "")
        got = dict(init_std=row["init_std"], lr=row["lr"], weight_decay=row["weight_decay"],
                   eps=row["eps"], forward=row["forward_multiplier"])
        assert got == pytest.approx(want), name
    # q k v o, experts and shared gate up down
    assert kinds == {"embedding": 1, "readout": 4, "hidden": 4 * 10}
    # the scale sites are vector-like: their LR does not follow the width (optim.scale_lr unset: lr)
    assert {s["lr"] for s in d["sites"] if s["lr"] is not None} == {LR}


def test_the_initialization_follows_the_width():
    cfg = compose_config([*TINY_MODEL, *SHAPE, *MUP, "scale=baseline"])
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=0)
    stds = {n: p.std().item() for n, p in model.named_parameters()}
    assert stds["tok_emb.weight"] == pytest.approx(SIGMA, rel=0.02)
    assert stds["layers.0.attn.wq.weight"] == pytest.approx(SIGMA / 2, rel=0.05)
    # the base depth's sqrt(2 * 2)
    assert stds["layers.3.ffn.w_down.weight"] == pytest.approx(SIGMA / 4, rel=0.05)


def _scaled_by_hand(mup: Transformer, sp: Transformer) -> None:
    """sp's weights made to compute what the mup model does, by the rules (written here, not read
    from the code): logits / m_N in an untied head, the routers' logits / m_N, q times the attention
    scale's ratio to 1 / sqrt(head_dim), and each residual branch's o / down times 1 / m_L."""
    with torch.no_grad():
        state = {n: p.clone() for n, p in mup.state_dict().items()}
        state["head.weight"] = state["tok_emb.weight"] / 4
        for name in list(state):
            if name.endswith("attn.wq.weight"):
                state[name] *= math.sqrt(8) / 32 * math.sqrt(32)
            elif name.endswith(("attn.wo.weight", "w_down.weight", "experts.w_down")):
                state[name] /= 2
            elif name.endswith("router.weight"):
                state[name] /= 4
        sp.load_state_dict(state)
    sp.init_buffers()


@pytest.mark.parametrize("moe", [False, True])
def test_the_forward_multipliers_are_the_rules(moe):
    """scale=baseline, whose maps have no output norms: the multipliers land on the
    weights themselves."""
    shape = ([*TINY_MOE, "model.moe.expert_dim=64", "model.moe.num_shared_experts=1"] if moe
             else TINY_MODEL)
    mup_cfg = compose_config([*shape, *SHAPE, *MUP, "scale=baseline"])
    sp_cfg = compose_config([*shape, *SHAPE, "scale=baseline", "model.tie_embeddings=false"])
    mup, sp = Transformer(mup_cfg.model, mup_cfg.scale), Transformer(sp_cfg.model, sp_cfg.scale)
    mup.init_weights(seed=1)
    with torch.no_grad():  # sites away from 1, so that nothing holds by their initial values
        for p in mup.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    _scaled_by_hand(mup, sp)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(mup(ids), sp(ids), rtol=1e-5, atol=1e-5)


def _train(model_cfg: ModelConfig, scale: ScaleConfig, optim: OptimConfig, steps: int = 3):
    torch.manual_seed(0)
    model = Transformer(model_cfg, scale)
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, optim)
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"]
    ids = torch.randint(0, model_cfg.vocab_size, (2, 17),
                        generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_after_step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("moe", [False, True])
def test_mup_at_its_base_shape_is_sp_bit_for_bit(optim, moe):
    base = ModelConfig(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=2, vocab_size=128,
                       moe=MoEConfig(num_experts=4, expert_dim=16) if moe else None)
    at_base = ModelConfig(**{**vars(base), "parameterization": "mup", "base_dim": 32,
                             "base_layers": 2, "base_head_dim": 8})
    scale = ScaleConfig(name="unified", heterogeneity="per_branch", placement="dual_norm",
                        reparam="or", weight_decay="iwd")
    opt = OptimConfig(name=optim, lr=0.01)
    sp_losses, sp_state = _train(base, scale, opt)
    mup_losses, mup_state = _train(at_base, scale, opt)
    assert sp_losses == mup_losses
    assert sp_state.keys() == mup_state.keys()
    for name in sp_state:
        assert torch.equal(sp_state[name], mup_state[name]), name


@pytest.mark.parametrize("overrides,key", [
    (["model.base_dim=32"], "model.base_dim"),
    (["model.parameterization=mup", "model.base_layers=0"], "model.base_layers"),
    (["model.parameterization=mup", "optim=muon", "optim.muon_router=true", "model=moe-tiny"],
     "optim.muon_router"),
])
def test_a_misread_base_is_refused_naming_the_key(overrides, key):
    with pytest.raises(ScalevecError) as e:
        compose_config(overrides)
    assert e.value.where == key


def test_a_checkpoint_written_before_the_option_existed_resumes(data_overrides, tmp_path):
    """A checkpoint's model record from before model.parameterization (and its base shape) lacks the
    keys: it ran as sp, their defaults, so resume=auto continues it; a record that says mup
    does not."""
    overrides = [*data_overrides, *TINY_MODEL, *SHORT_RUN, "model.vocab_size=512",
                 "checkpoint.every=2", f"run_dir={tmp_path / 'run'}"]
    run(make_config(*overrides, "train.steps=2"))
    state_file = next((tmp_path / "run" / "checkpoints").glob("step_*/train_state.json"))
    state = json.loads(state_file.read_text())
    for key in ("parameterization", "base_dim", "base_layers", "base_head_dim"):
        del state["model_config"][key]
    state_file.write_text(json.dumps(state))
    # as old as that: no checksums either (integrity.py reads such a checkpoint unverified, with
    # a note)
    (state_file.parent / "checksums.json").unlink()
    (state_file.parent / "COMPLETE").write_text("")
    run(make_config(*overrides, "train.steps=4", "resume=auto"))
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "COMPLETE").is_file()
    assert architecture_diff(state["model_config"],
                             {**state["model_config"], "parameterization": "mup"}) == \
        ["parameterization"]

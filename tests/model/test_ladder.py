"""The scaling ladder (configs/model/dense-l*, moe-l*): every rung follows the one rule, depth L,
width 32 L, L heads of 32, SwiGLU 3 x width, so N = 13 L width^2 non-embedding parameters; the MoE
twin splits each feed-forward into 8 experts of 1.5 x width, top-2. Sizes are counted on a
meta-device model and compared with the rule's closed forms."""

import dataclasses
from pathlib import Path

import pytest
import torch

from scalevec_train.config import CONFIG_DIR
from scalevec_train.costs.accounting import active_params, non_embedding_params, total_params
from scalevec_train.model.transformer import Transformer
from tests.support.helpers import make_config

RUNGS = [1, 2, 3, 4, 6, 8, 12, 16, 20]


def built(model: str) -> tuple:
    cfg = make_config(f"model={model}")
    with torch.device("meta"):
        return cfg.model, Transformer(cfg.model, cfg.scale)


def test_the_ladder_is_every_rung_in_both_families():
    found = {p.stem for p in (Path(CONFIG_DIR) / "model").glob("*-l*.yaml")}
    assert found == {f"{family}-l{rung}" for family in ("dense", "moe") for rung in RUNGS}


@pytest.mark.parametrize("rung", RUNGS)
def test_dense_rung_follows_the_rule(rung):
    cfg, model = built(f"dense-l{rung}")
    width = 32 * rung
    assert ((cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim)
            == (rung, width, rung, rung, 3 * width))
    assert non_embedding_params(model) == 13 * rung * width**2 == 13312 * rung**3
    # plus the tied embedding and the baseline's norm gains (two per block and the final one)
    assert total_params(model) == 13312 * rung**3 + cfg.vocab_size * width + (2 * rung + 1) * width


@pytest.mark.parametrize("rung", RUNGS)
def test_moe_rung_is_its_dense_twin_with_experts(rung):
    cfg, model = built(f"moe-l{rung}")
    width = 32 * rung
    dense, _ = built(f"dense-l{rung}")
    assert {k: getattr(cfg, k)
            for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")} == \
        {k: getattr(dense, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")}
    moe = cfg.moe
    assert ((moe.num_experts, moe.top_k, moe.expert_dim, moe.num_shared_experts)
            == (8, 2, 3 * width // 2, 0))
    router = 8 * width * rung
    # a token passes through 2 of 8 experts of 1.5 x width: the dense SwiGLU's 9 width^2 weights
    assert non_embedding_params(model) == 13312 * rung**3 + router
    experts = 8 * 3 * width * (3 * width // 2) * rung
    embedding_and_norms = cfg.vocab_size * width + (2 * rung + 1) * width
    assert total_params(model) == 4 * width**2 * rung + experts + router + embedding_and_norms
    assert active_params(model) == total_params(model) - experts * 6 // 8


def test_the_ladder_spans_the_study_model_to_dense_0_12b():
    """Rung 4 is about dense-study's size, rung 20 about dense-0.12b's
    (non-embedding parameters)."""
    n = {name: non_embedding_params(built(name)[1])
         for name in ("dense-study", "dense-l4", "dense-0.12b", "dense-l20")}
    assert 1 < n["dense-l4"] / n["dense-study"] < 1.25
    assert 1 < n["dense-l20"] / n["dense-0.12b"] < 1.25


PRESETS = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml"))


@pytest.fixture(scope="module")
def strategies() -> dict:
    return {name: make_config(f"scale={name}").scale for name in ("baseline", "unified", "dnp")}


@pytest.mark.parametrize("preset", PRESETS)
def test_the_size_the_config_derives_is_the_built_models(preset, strategies):
    """train.tokens_per_param reads N from the shapes (ModelConfig.non_embedding_params, no model
    built): it is the count of the built model's parameters under every strategy (sites are not
    counted), with QK-norm and post-norm too, and a shared expert counts whole."""
    model_cfg = make_config(f"model={preset}").model
    variants = [(model_cfg, strategies["baseline"]), (model_cfg, strategies["unified"]),
                (dataclasses.replace(model_cfg, qk_norm=True), strategies["dnp"]),
                (dataclasses.replace(model_cfg, post_norm=True), strategies["baseline"])]
    if model_cfg.moe is not None:
        moe = dataclasses.replace(model_cfg.moe, num_shared_experts=2, shared_expert_dim=48)
        variants.append((dataclasses.replace(model_cfg, moe=moe), strategies["unified"]))
    for model, scale in variants:
        with torch.device("meta"):
            assert (model.non_embedding_params()
                    == non_embedding_params(Transformer(model, scale))), scale.name

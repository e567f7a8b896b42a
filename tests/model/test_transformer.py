"""The dense decoder: causality, preset sizes, initialization, against independent references."""

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.model import Transformer
from tests.support.helpers import make_config_shared
from tests.support.presets import TINY_MODEL

SIZES = {"dense-tiny": 4.2e6, "dense-0.12b": 0.12e9, "dense-0.5b": 0.5e9, "dense-1b": 1.0e9,
         "dense-2b": 2.0e9, "dense-gemma-0.5b": 0.5e9, "dense-tiny-gemma": 4.2e6}


@pytest.mark.parametrize("preset", sorted(SIZES))
def test_preset_parameter_count_matches_its_name(preset):
    cfg = make_config_shared(f"model={preset}")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - SIZES[preset]) / SIZES[preset] <= 0.10, f"{preset}: {total:,}"


@pytest.mark.parametrize("extra",
                         [[], ["scale=unified"], ["model.qk_norm=true", "model.post_norm=true"]])
def test_causality(extra):
    cfg = make_config_shared("model.n_layers=2", *extra)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    x = torch.randint(0, cfg.model.vocab_size, (2, 40))
    y = x.clone()
    y[:, 25:] = torch.randint(0, cfg.model.vocab_size, (2, 15))
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :25], b[:, :25], rtol=0, atol=1e-6)
    assert (a[:, 25:] - b[:, 25:]).abs().max() > 1e-3


def test_forward_matches_a_plain_reference():
    """One block written out by hand (repeat-kv attention with an explicit mask,
    rotate-half RoPE)."""
    cfg = make_config_shared("model.n_layers=1", "model.tie_embeddings=false")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(3)
    c = cfg.model
    x_ids = torch.randint(0, c.vocab_size, (2, 17))
    blk = model.layers[0]

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps)

    def rope(t):  # [b, h, s, d]
        d = t.shape[-1]
        inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2).double() / d)
        ang = torch.outer(torch.arange(t.shape[2]).double(), inv)
        cos, sin = ang.cos().float(), ang.sin().float()
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    x = model.tok_emb.weight[x_ids]
    a = rms(x)
    b_, s_, hd = x.shape[0], x.shape[1], c.head_dim
    q = (a @ blk.attn.wq.weight.T).view(b_, s_, c.n_heads, hd).transpose(1, 2)
    k = (a @ blk.attn.wk.weight.T).view(b_, s_, c.n_kv_heads, hd).transpose(1, 2)
    v = (a @ blk.attn.wv.weight.T).view(b_, s_, c.n_kv_heads, hd).transpose(1, 2)
    rep = c.n_heads // c.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = rope(q) @ rope(k).transpose(-1, -2) / hd**0.5
    scores = scores.masked_fill(torch.ones(s_, s_).triu(1).bool(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b_, s_, -1)
    h = x + att @ blk.attn.wo.weight.T
    bb = rms(h)
    f = blk.ffn
    y = h + (F.silu(bb @ f.w_gate.weight.T) * (bb @ f.w_up.weight.T)) @ f.w_down.weight.T
    logits = rms(y) @ model.head.weight.T
    torch.testing.assert_close(model(x_ids), logits, rtol=1e-4, atol=1e-5)


def test_init_depends_only_on_seed_and_name():
    """A parameter's initial value is a function of (seed, name): models that differ before it (the
    embedding's size), around it (the scale sites of a strategy) and after it (an untied output
    head) give every parameter they share the same value; another name or another seed gives
    another value."""
    models = {}
    for key, extra in {"base": [], "vocab": ["model.vocab_size=3000"], "unified": ["scale=unified"],
                       "untied": ["model.tie_embeddings=false"]}.items():
        cfg = make_config_shared(*TINY_MODEL, *extra)
        models[key] = Transformer(cfg.model, cfg.scale)
        models[key].init_weights(5)
    base = dict(models["base"].named_parameters())
    for key in ("vocab", "unified", "untied"):
        shared = [(n, p) for n, p in models[key].named_parameters()
                  if n in base and p.shape == base[n].shape]
        assert len(shared) >= 2 * 7, key  # at least the seven matrices of both blocks
        for name, p in shared:
            assert torch.equal(p, base[name]), (key, name)
    wq, wk = base["layers.0.attn.wq.weight"], base["layers.0.attn.wk.weight"]
    assert not torch.equal(wq, wk)  # same shape, another name
    reseeded = Transformer(models["base"].cfg, models["base"].scale)
    reseeded.init_weights(6)
    assert not torch.equal(wq, reseeded.layers[0].attn.wq.weight)
    # the scale: init_std, and init_std / sqrt(2 * n_layers) for the maps into the residual stream
    cfg = make_config_shared("model.n_layers=2")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(5)
    assert model.layers[0].attn.wo.weight.std().item() == pytest.approx(0.02 / 2, rel=0.1)
    assert model.layers[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)

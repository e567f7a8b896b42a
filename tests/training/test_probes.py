"""train.diagnostics_every (training/diagnostics.py): off, a run is what it was; on, its losses are
the same and every diag/* value equals the one computed here, by hand, from the checkpointed weights
of the step (and the step before, for the update) and a plain PyTorch forward of the diagnostic
batch, for the baseline and the unified strategy (causal, and within documents) and an MoE model; on
2 gloo ranks with compiled blocks the values are those of one eager process."""

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

import scalevec_train
from scalevec_train.checkpoint.files import step_dir
from scalevec_train.data import prepare_data
from scalevec_train.data.sources import validation_batches
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model import Transformer, scale_sites
from scalevec_train.train import run
from scalevec_train.training.probes import activation_stats
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.launch import records, train_spawned
from tests.support.presets import TINY_MODEL, TINY_MOE

STEPS = ["train.steps=4", "train.log_every=2"]
ON = "train.diagnostics_every=2"
MOE = [*TINY_MOE, "model.moe.num_experts=4", "model.vocab_size=512"]
NUMBERS = ("step", "loss", "grad_norm", "val_loss", "val_bpb")

# The maps that read each input-side site under a strategy, written out here from
# docs/concepts/scale-vectors.md: {map path within a block: the site path within the block}; maps
# not listed have no input-side scale.
INPUT_SITES = {
    "baseline": {"attn.wq": "attn_norm.sites.attn", "attn.wk": "attn_norm.sites.attn",
                 "attn.wv": "attn_norm.sites.attn", "ffn.w_gate": "ffn_norm.sites.ffn",
                 "ffn.w_up": "ffn_norm.sites.ffn"},
    # HG: one site per branch (dual_norm adds output sites only, behind normalizations)
    "unified": {"attn.wq": "attn_norm.sites.q", "attn.wk": "attn_norm.sites.k",
                "attn.wv": "attn_norm.sites.v", "ffn.w_gate": "ffn_norm.sites.gate",
                "ffn.w_up": "ffn_norm.sites.up"},
    # an MoE layer under baseline: the router, every expert and the shared expert read the one ffn
    # site
    "moe": {"attn.wq": "attn_norm.sites.attn", "attn.wk": "attn_norm.sites.attn",
            "attn.wv": "attn_norm.sites.attn", "ffn.router": "ffn_norm.sites.ffn",
            "ffn.experts.w_gate": "ffn_norm.sites.ffn", "ffn.experts.w_up": "ffn_norm.sites.ffn",
            "ffn.shared.w_gate": "ffn_norm.sites.ffn", "ffn.shared.w_up": "ffn_norm.sites.ffn"},
}
CASES = {"baseline": ["scale=baseline"], "unified": ["scale=unified"],
         "moe": [*MOE, "scale=baseline"]}


def diag(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith("diag/")}


def test_off_is_the_plain_run_and_on_changes_no_number(tmp_path, data_overrides):
    common = [*data_overrides, *TINY_MODEL, *SHORT_RUN, *STEPS, "scale=unified"]
    off = run(make_config(*common, f"run_dir={tmp_path / 'off'}"))
    on = run(make_config(*common, ON, f"run_dir={tmp_path / 'on'}"))
    assert not any(diag(r) for r in records(off))
    assert [r["step"] for r in records(on) if diag(r)] == [2, 4]
    assert [{k: r[k] for k in NUMBERS if k in r} for r in records(on)] == \
        [{k: r[k] for k in NUMBERS if k in r} for r in records(off)]


def test_every_must_be_a_multiple_of_log_every(data_overrides):
    with pytest.raises(ScalevecError, match="train.diagnostics_every"):
        make_config(*data_overrides, *STEPS, "train.diagnostics_every=3")


# The reference: column statistics of W and of W diag(g) formed explicitly, and a plain forward.

def column_stats(w: torch.Tensor, g: torch.Tensor | None, before: torch.Tensor) -> dict[str, float]:
    c = torch.linalg.vector_norm(w, dim=-2).flatten().double()
    out = {"weight_rms": w.double().square().mean().sqrt(), "col_rms": c.square().mean().sqrt(),
           "col_cv": c.std(unbiased=False) / c.mean(),
           "update_ratio": torch.linalg.vector_norm(w - before) / torch.linalg.vector_norm(before)}
    if g is not None:
        e = torch.linalg.vector_norm(w * g.unsqueeze(-2), dim=-2).flatten().double()
        out |= {"eff_col_rms": e.square().mean().sqrt(),
                "eff_col_cv": e.std(unbiased=False) / e.mean(),
                "col_gain": e.square().mean().sqrt() / c.square().mean().sqrt()}
        gs = g.abs().expand(w.shape[:-2] + w.shape[-1:]).flatten().double()
        out["g_col_corr"] = 0.0 if gs.std() == 0 else torch.corrcoef(torch.stack([gs, c]))[0, 1]
    return {k: float(v) for k, v in out.items()}


def expected_weights(model, before, strategy: str) -> dict[str, float]:
    params, old = dict(model.named_parameters()), dict(before.named_parameters())
    out = {}
    for name, w in params.items():
        if w.dim() < 2 or name == "tok_emb.weight" and model.head is not None:
            continue
        path = name.removesuffix(".weight")
        if path in ("head", "tok_emb"):
            key, g = "diag/head", model.final_norm.sites["final"]()
        else:
            _, layer, within = path.split(".", 2)
            site = INPUT_SITES[strategy].get(within)
            g = model.layers[int(layer)].get_submodule(site)() if site else None
            key = f"diag/layer{layer}/{within}"
        stats = column_stats(w.detach(), None if g is None else g.detach(), old[name].detach())
        out |= {f"{key}/{k}": v for k, v in stats.items()}
    old_sites = dict(scale_sites(before))
    for path, site in scale_sites(model):
        if site.param == "fixed":
            continue
        s, s_old = site().detach().double(), old_sites[path]().detach().double()
        layer, within = path.split(".", 2)[1:] if path.startswith("layers.") else (None, path)
        key = f"diag/{within}" if layer is None else f"diag/layer{layer}/{within}"
        out |= {f"{key}/scale_rms": rms(s), f"{key}/scale_mean": float(s.mean()),
                f"{key}/scale_update_ratio": float((s - s_old).norm() / s_old.norm())}
    return out


def rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def outliers(key: str, x: torch.Tensor, out: dict[str, float]) -> None:
    """A map input's kurtosis and max / RMS, in float64."""
    x = x.double()
    centered = x - x.mean()
    out[f"{key}/in_kurtosis"] = float(centered.pow(4).mean() / centered.square().mean().square())
    out[f"{key}/in_max_rms"] = float(x.abs().max()) / rms(x)


def norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, seq, dim] rotated by positions [batch, seq]."""
    dim = x.shape[-1]
    angles = positions[:, None, :, None].double() * theta ** (-torch.arange(0, dim, 2) / dim)
    angles = torch.cat([angles, angles], -1)
    x1, x2 = x.chunk(2, -1)
    return (x * angles.cos() + torch.cat([-x2, x1], -1) * angles.sin()).float()


def output_side(lin, y: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """What the strategies here put on a map's output: nothing, or u * N(y) per head (q, k, v) or
    over the whole width (gate, up)."""
    if lin.out_site is None:
        return y
    u = lin.out_site()
    if lin.out_norm == "head":
        return (norm(y.unflatten(-1, (-1, head_dim)), eps) * u).flatten(-2)
    return norm(y, eps) * u


@torch.no_grad()
def expected_activations(model, tokens: torch.Tensor, doc_ids: torch.Tensor | None,
                         inputs: dict[str, float] | None = None) -> dict[str, float]:
    """A layer-by-layer forward in plain PyTorch, fp32, causal or within the documents doc_ids
    number (each a contiguous run of a row, RoPE positions restarting at each); its logits must be
    the model's. `inputs`, where given, gets the outliers of every block map's input."""
    cfg, eps, out = model.cfg, model.cfg.norm_eps, {}
    inputs = {} if inputs is None else inputs
    seq = tokens.shape[1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril().expand(len(tokens), 1, seq, seq)
    positions = torch.arange(seq).expand_as(tokens)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
        positions = positions - (doc_ids[:, None, :] < doc_ids[:, :, None]).sum(-1)
    x = model.tok_emb.weight[tokens]
    for i, block in enumerate(model.layers):
        p = f"diag/layer{i}"
        out[f"{p}/resid_rms"] = rms(x)
        a = {b: norm(x, eps) * site() for b, site in block.attn_norm.sites.items()}
        out |= {f"{p}/attn_norm.{b}/rms": rms(v) for b, v in a.items()}
        heads = {}
        for name, branch in (("wq", "q"), ("wk", "k"), ("wv", "v")):
            lin = getattr(block.attn, name)
            outliers(f"{p}/attn.{name}", a.get(branch, a.get("attn")), inputs)
            y = output_side(lin, a.get(branch, a.get("attn")) @ lin.weight.T, cfg.head_dim, eps)
            if lin.out_norm is not None:
                out[f"{p}/attn.{name}/out_rms"] = rms(y)
            heads[branch] = y.unflatten(-1, (-1, cfg.head_dim)).transpose(1, 2)
        group = cfg.n_heads // cfg.n_kv_heads
        q = rope(heads["q"], cfg.rope_theta, positions)
        k = rope(heads["k"], cfg.rope_theta, positions).repeat_interleave(group, 1)
        v = heads["v"].repeat_interleave(group, 1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)).masked_fill(~allowed,
                                                                                 -math.inf)
        out[f"{p}/attn/max_logit"] = float(scores.max())
        attended = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
        outliers(f"{p}/attn.wo", attended, inputs)
        h = x + attended @ block.attn.wo.weight.T
        out[f"{p}/resid_mid_rms"] = rms(h)
        b = {br: norm(h, eps) * site() for br, site in block.ffn_norm.sites.items()}
        out |= {f"{p}/ffn_norm.{br}/rms": rms(v) for br, v in b.items()}
        # the layer itself: its inside is not measured, its input and output are
        if cfg.moe is not None:
            x = h + block.ffn(b)
            continue
        ffn, shared = block.ffn, b.get("ffn")
        outliers(f"{p}/ffn.w_gate", b.get("gate", shared), inputs)
        outliers(f"{p}/ffn.w_up", b.get("up", shared), inputs)
        gate = output_side(ffn.w_gate, b.get("gate", shared) @ ffn.w_gate.weight.T, cfg.head_dim,
                           eps)
        up = output_side(ffn.w_up, b.get("up", shared) @ ffn.w_up.weight.T, cfg.head_dim, eps)
        for name, y in (("w_gate", gate), ("w_up", up)):
            if getattr(ffn, name).out_norm is not None:
                out[f"{p}/ffn.{name}/out_rms"] = rms(y)
        outliers(f"{p}/ffn.w_down", F.silu(gate) * up, inputs)
        x = h + (F.silu(gate) * up) @ ffn.w_down.weight.T
    out["diag/final/resid_rms"] = rms(x)
    final = norm(x, eps) * model.final_norm.sites["final"]()
    out["diag/final_norm.final/rms"] = rms(final)
    head = model.tok_emb.weight if model.head is None else model.head.weight
    torch.testing.assert_close(final @ head.T, model(tokens, doc_ids=doc_ids), rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_are_those_computed_from_the_weights_and_a_plain_forward(
        tmp_path, data_overrides, case):
    overrides = [*data_overrides, *TINY_MODEL, *SHORT_RUN, *STEPS, ON, *CASES[case],
                 "checkpoint.every=1", f"run_dir={tmp_path / 'r'}"]
    out = run(make_config(*overrides))
    got = diag(next(r for r in records(out) if r["step"] == 4 and diag(r)))
    model, _ = scalevec_train.load(step_dir(out, 4))
    before, _ = scalevec_train.load(step_dir(out, 3))
    cfg = make_config(*overrides)
    t = cfg.train  # the val split's first micro-batch:
    batch = validation_batches(prepare_data(cfg.data), t.seq_len, t.micro_batch,
                               t.eval_batches * t.global_batch, 0, 1,
                               cfg.model.attention_mask == "document")[0]
    inputs = {}
    expected = (expected_weights(model, before, case)
                | expected_activations(model, batch.inputs, batch.doc_ids, inputs) | inputs)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # the preconditioning is there to see: the input-side scales have left 1 and reshaped the
    # columns
    assert any(abs(v - 1) > 1e-4 for k, v in got.items() if k.endswith("/col_gain"))


def test_activations_within_documents(data_overrides):
    """Attention and RoPE positions within documents (the corpus's documents outlast a training row,
    so here rows of several documents are made up), on a unified model whose sites have left 1."""
    cfg = make_config(*data_overrides, *TINY_MODEL, "scale=unified",
                      "model.attention_mask=document", "model.rope_reset=true")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    with torch.no_grad():
        for _, site in scale_sites(model):
            for p in site.parameters():
                p.mul_(1 + 0.3
                       * torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32),
                           generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 10 + [1] * 12 + [2] * 10, [0] * 3 + [1] * 29])
    got = activation_stats(model, tokens, doc_ids, nullcontext)
    expected = expected_activations(model, tokens, doc_ids)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert float(got[key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # the documents matter: attending across them gives other largest logits
    causal = expected_activations(model, tokens, None)
    assert any(causal[k] != pytest.approx(v, rel=1e-3) for k, v in expected.items()
               if k.endswith("max_logit"))


def test_two_ranks_with_compiled_blocks_measure_what_one_eager_process_does(
        tmp_path, data_overrides):
    """FSDP2 shards every matrix (row-wise) and the expert stacks (by expert) over 2 ranks; the
    blocks are compiled, so the diagnostic forward must step around the compiled forward (its hooks
    see nothing inside a graph). Compiled with aot_eager: what dynamo captures, and the graphs'
    forward and backward, are inductor's; that inductor's numbers are eager's is
    tests/parallel/test_compile.py's (its code generation costs minutes of CPU on a fresh machine).
    Baseline strategies: unified's cancelled magnitudes drift apart on different world sizes
    (tests/parallel/test_world_sizes.py), and with them what they scale."""
    prepare_data(make_config(*data_overrides).data)
    runs = {name: [*data_overrides, *TINY_MODEL, *SHORT_RUN, *STEPS, ON, *CASES[name],
                   "train.global_batch=4", "train.micro_batch=2"] for name in ("baseline", "moe")}
    spec = [[*o, "distributed.compile=true", f"run_dir={tmp_path / name}-2"]
            for name, o in runs.items()]
    train_spawned(2, spec, tmp_path / "runs.json", backend="aot_eager")
    for name, o in runs.items():
        one = run(make_config(*o, f"run_dir={tmp_path / name}-1"))
        got = [diag(r) for r in records(tmp_path / f"{name}-2") if diag(r)]
        expected = [diag(r) for r in records(one) if diag(r)]
        assert len(got) == len(expected) == 2 and sorted(got[-1]) == sorted(expected[-1])
        for g, e in zip(got, expected, strict=True):
            for key, value in e.items():
                assert g[key] == pytest.approx(value, rel=1e-3, abs=1e-5), (name, key)

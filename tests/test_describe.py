"""`describe`: the sites of a model under a strategy, their cost, and the magnitudes a normalization
cancels, against counts written out by hand and against autograd."""

import json
import subprocess
import sys

import pytest
import torch

from scalevec_train.costs.tables import describe, format_table
from scalevec_train.describe import main
from scalevec_train.model import Transformer
from scalevec_train.model.strategies import scale_sites
from scalevec_train.training.callbacks.scales import site_grad_norms, site_prefix
from tests.support.helpers import make_config_shared
from tests.support.presets import SMALL_MODEL


def describe_json(*overrides: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "scalevec_train.describe", *overrides,
                          "format=json"],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(run.stdout)


def per_layer(d: dict, layer: int) -> dict[str, dict]:
    return {s["name"].removeprefix(f"layers.{layer}."): s for s in d["sites"]
            if s["name"].startswith(f"layers.{layer}.")}


def test_dense_unified_acceptance():
    """Per layer: five input sites of the model width, five output sites behind norms (three of
    head_dim, two of ffn_dim), nothing on o or down."""
    d = describe_json("model=dense-tiny", "scale=unified")
    for layer in range(4):
        sites = per_layer(d, layer)
        inputs = {n: s for n, s in sites.items() if s["role"] == "input"}
        outputs = {n: s for n, s in sites.items() if s["role"] == "output"}
        assert sorted(inputs) == [f"attn_norm.sites.{b}" for b in "kqv"] + [
            "ffn_norm.sites.gate", "ffn_norm.sites.up"]
        assert all(s["shape"] == [256] and not s["behind_norm"] for s in inputs.values())
        assert {n: s["shape"] for n, s in outputs.items()} == {
            "attn.wq.out_site": [64], "attn.wk.out_site": [64], "attn.wv.out_site": [64],
            "ffn.w_gate.out_site": [688], "ffn.w_up.out_site": [688]}
        assert all(s["behind_norm"] for s in outputs.values())
        assert not [n for n in sites if ".wo." in n or ".w_down." in n]
        # Under dnp every input site of a pre-norm map feeds maps that are normalized right after.
        assert {n: s["magnitude_cancelled_by"] for n, s in inputs.items()} == {
            "attn_norm.sites.q": "N_h(q)", "attn_norm.sites.k": "N_h(k)",
            "attn_norm.sites.v": "N_h(v)",
            "ffn_norm.sites.gate": "N(gate)", "ffn_norm.sites.up": "N(up)"}
    final = [s for s in d["sites"] if s["name"] == "final_norm.sites.final"]
    assert final and final[0]["magnitude_cancelled_by"] is None


def test_moe_unified_has_per_expert_output_sites():
    d = describe_json("model=moe-tiny", "scale=unified")
    sites = per_layer(d, 0)
    assert (sites["ffn.experts.gate_out"]["shape"] == [8, 128]
            and sites["ffn.experts.up_out"]["shape"] == [8, 128])
    assert sites["ffn.shared.gate_out"]["shape"] == [128]
    assert sites["ffn.experts.gate_out"]["behind_norm"]
    # The router reads the pre-norm unnormalized: its site's magnitude matters.
    assert sites["ffn_norm.sites.router"]["magnitude_cancelled_by"] is None
    assert sites["ffn_norm.sites.gate"]["magnitude_cancelled_by"] == "N(gate)"


@pytest.mark.parametrize("model,extra_per_layer", [
    # q: norm 3*256 + site 256; k, v: 3*128 + 128 each; gate, up: 3*688 + 688 each; the pre-norms
    # feed three and two sites instead of one.
    ("dense-tiny", 4 * 256 + 2 * 4 * 128 + 2 * 4 * 688 + 2 * 256 + 256),
    # attention as above; the ffn pre-norm feeds gate, up and router; each of the top-2 experts and
    # the shared expert normalize and scale gate and up over their hidden width of 128.
    ("moe-tiny", 4 * 256 + 2 * 4 * 128 + 2 * 256 + 2 * 256 + (2 + 1) * 2 * 4 * 128),
])
def test_extra_flops_of_unified_count_every_new_norm(model, extra_per_layer):
    """3 FLOPs per normalized element, 1 per scaled element, forward; training is 3x forward."""
    d = describe(make_config_shared(f"model={model}", "scale=unified"))
    assert d["extra_train_flops_per_token"] == 3 * 4 * extra_per_layer


def test_cancelled_magnitudes_get_no_gradient():
    """What describe marks is what autograd finds: the or-magnitude of every marked site has
    (almost) no gradient, every other one a clear gradient (a tiny eps so that it barely leaks; the
    norms compute in fp32, whose rounding leaves about 1e-6 of the terms that cancel)."""
    cfg = make_config_shared("scale=unified", *SMALL_MODEL, "model.vocab_size=128",
                             "model.norm_eps=1e-12")
    model = Transformer(cfg.model, cfg.scale).double()
    model.init_weights(0)
    # not the global one: its state depends on the tests run before
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, site in scale_sites(model):
            site.alpha.copy_(1 + 0.3 * torch.randn(site.alpha.shape, dtype=torch.float64,
                                                   generator=gen))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x).logsumexp(-1).mean().backward()
    norms = site_grad_norms(model)
    marked = {m.site for m in model.site_maps() if m.cancelled_by}
    paths = dict((site, path) for path, site in scale_sites(model))
    live = [norms[f"{site_prefix(path, magnitude=True)}/grad_norm"]
            for site, path in paths.items() if site not in marked and path.startswith("layers.")]
    dead = [norms[f"{site_prefix(path, magnitude=True)}/grad_norm"] for site, path in paths.items()
            if site in marked]
    assert len(dead) == 2 * 5 and len(live) == 2 * 5
    assert max(dead) < 1e-3 * min(live)


def test_each_site_shows_its_peak_lr_and_decay(capsys):
    """Per site: the peak LR (optim.scale_lr; null: the other AdamW groups') and the decay rate with
    the parameters it acts on (unified: the magnitudes of the input sites; decay_final_norm=false:
    not the final norm's; reparam_decay=all_params: beta and alpha), as the table and the JSON show
    them."""
    d = describe(make_config_shared("model=dense-tiny", "scale=unified", "optim=muon",
                                    "optim.adamw_lr=1e-3", "optim.scale_lr=2e-3",
                                    "optim.scale_weight_decay=0.05",
                                    "scale.decay_final_norm=false"))
    assert len(d["sites"]) == 4 * 10 + 1
    for s in d["sites"]:
        decayed = s["role"] == "input" and s["name"] != "final_norm.sites.final"
        expected = (2e-3, 0.05, ["beta"]) if decayed else (2e-3, 0.0, [])
        assert (s["lr"], s["weight_decay"], s["decayed"]) == expected, s["name"]
    d = describe(make_config_shared("model=dense-tiny", "scale=unified",
                                    "scale.reparam_decay=all_params", "optim.lr=4e-3",
                                    "optim.weight_decay=0.2"))
    for s in d["sites"]:
        expected = (4e-3, 0.2, ["beta", "alpha"]) if s["role"] == "input" else (4e-3, 0.0, [])
        assert (s["lr"], s["weight_decay"], s["decayed"]) == expected, s["name"]
    assert ("  -  final_norm.sites.final       input  or    256          0.004    0.2 "
            "on beta+alpha") in format_table(d)
    assert main(["model=dense-tiny", "scale=none", "format=json"]) == 0
    final = next(s for s in json.loads(capsys.readouterr().out)["sites"]
                 if s["name"] == "final_norm.sites.final")
    # fixed: no parameter
    assert (final["lr"], final["weight_decay"], final["decayed"]) == (None, 0.0, [])


def test_describe_reports_expert_parallelism(capsys):
    """`describe world_size=8 distributed.expert_parallel=4`: the memory per rank with a block's
    experts gathered for the rank's EP slice only, and the bytes each rank sends per step in the
    all-to-alls, communication.py's formula written out here for moe-tiny (2 of 8 experts chosen,
    gate and up read one branch under baseline): rows of 4 layers x tokens x 2 chosen x 3/4
    off-rank, dispatched with their routing weight (dim + 1 bf16 values) and combined (dim), forward
    and backward."""
    common = ["model=moe-tiny", "world_size=8", "format=json"]
    assert main([*common, "distributed.expert_parallel=4"]) == 0
    with_ep = json.loads(capsys.readouterr().out)["memory"]
    assert main(common) == 0
    without = json.loads(capsys.readouterr().out)["memory"]
    assert (with_ep["expert_parallel"], without["all_to_all_bytes_per_step"]) == (4, None)
    tokens = with_ep["micro_batch_tokens"] * with_ep["accumulation"]
    dim = 256
    assert (with_ep["all_to_all_bytes_per_step"]
            == 4 * tokens * 2 * 3 / 4 * ((dim + 1) * 2 + dim * 2) * 2)
    assert with_ep["fsdp_buffers"] < without["fsdp_buffers"]
    # the same count of ranks shards them
    for key in ("params", "grads", "optimizer", "activations"):
        assert with_ep[key] == without[key], key


def test_describe_lists_each_matrix_precision_and_why_under_fp8(capsys):
    """`describe model=dense-tiny model.fp8=rowwise`: every block map below torchao's thresholds
    stays bf16 and says so; under model.fp8_filter=all the 28 block maps run in FP8 and nothing else
    does; without model.fp8 no such table."""
    assert main(["model=dense-tiny", "model.fp8=rowwise"]) == 0
    out = capsys.readouterr().out
    assert ("model.fp8=rowwise, model.fp8_filter=auto: 0 of 29 matrices in FP8 (MFU stays against "
            "the bf16 peak)") in out
    assert ("layers.*.ffn.w_gate.weight         all      688x256        bf16                     "
            "below torchao's size thresholds for rowwise, where FP8 was slower than bf16 "
            "(model.fp8_filter=all converts it)") in out
    assert ("tok_emb.weight                     -        4096x256       bf16                     "
            "the embedding: a lookup (and the tied head's weight)") in out
    assert main(["model=dense-tiny", "model.fp8=rowwise", "model.fp8_filter=all",
                 "format=json"]) == 0
    maps = json.loads(capsys.readouterr().out)["fp8"]["maps"]
    assert {m["name"] for m in maps if m["fp8"]} == {
        f"layers.{i}.{path}.weight" for i in range(4) for path in (
            "attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_up", "ffn.w_down")}
    assert {m["precision"] for m in maps if m["fp8"]} == {"fp8 rowwise"}
    assert main(["model=dense-tiny"]) == 0 and "model.fp8" not in capsys.readouterr().out

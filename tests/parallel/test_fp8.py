"""FP8 training (model.fp8, parallel/fp8.py), emulated on the CPU: which maps convert on every
preset (a table written here from torchao's thresholds), each converted map against bf16 by
signal-to-noise, the forward and backward on 2 gloo ranks against one process, torch.compile without
a graph break, activation checkpointing equal to none, the default path without torchao, and the
diagnostics of FP8's casts and gradients."""

from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.layers import Linear
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import (
    parallelize,
    reduce_replicated_grads,
    replicated_params,
)
from scalevec_train.parallel.fp8 import convert as convert_fp8
from scalevec_train.parallel.fp8 import gathered_in_fp8, map_precisions, precompute_scales
from scalevec_train.parallel.process_group import full_value
from scalevec_train.parallel.wrap import wrap_block
from scalevec_train.training.probes import fp8_grad_snr, map_input_stats
from scalevec_train.training.trainer import cross_entropy
from tests.support.helpers import hide_package, make_config_shared
from tests.support.launch import compile_backend, gloo_group, spawn
from tests.support.presets import SMALL_MODEL

CPU = torch.device("cpu")
MAPS = ("q", "k", "v", "o", "gate", "up", "down")
PATHS = {"q": "attn.wq", "k": "attn.wk", "v": "attn.wv", "o": "attn.wo", "gate": "ffn.w_gate",
         "up": "ffn.w_up", "down": "ffn.w_down"}
# The block maps model.fp8_filter=auto converts, from torchao's size thresholds for weights [N out,
# K in] (tensorwise: not K <= 4096 and N <= 1024; rowwise: N > 2048, K > 1024 and not N <= 4096 and
# K <= 2048), worked out by hand for each preset's shapes.
AUTO = {
    "dense-tiny": {"tensorwise": (), "rowwise": ()},
    "dense-0.12b": {"tensorwise": ("gate", "up"), "rowwise": ()},  # 768 wide, FFN 2304
    # k, v: 512 x 1536
    "dense-0.5b": {"tensorwise": ("q", "o", "gate", "up", "down"), "rowwise": ()},
    "dense-gemma-0.5b": {"tensorwise": ("q", "o", "gate", "up", "down"), "rowwise": ()},
    # FFN 8192
    "dense-1b": {"tensorwise": ("q", "o", "gate", "up", "down"), "rowwise": ("gate", "up")},
    "dense-2b": {"tensorwise": ("q", "o", "gate", "up", "down"),
                 "rowwise": ("q", "o", "gate", "up", "down")},
    "moe-0.5b": {"tensorwise": (), "rowwise": ()},  # attention 768 wide; experts stay
    "moe-2b": {"tensorwise": (), "rowwise": ()},  # attention 1024 x 1024: N <= 1024
}
# SNR floors (dB) of a converted map's output, input gradient and weight gradient against bf16's,
# per recipe: e4m3 keeps 3 mantissa bits (about 28.5 dB measured on every map of SMALL_MODEL),
# tensorwise's gradients are e5m2 (2 bits: about 24.5 dB); rowwise_with_gw_hp's weight gradient is
# bf16's own matmul.
SNR_FLOOR = {"tensorwise": (26, 22, 22), "rowwise": (26, 26, 26),
             "rowwise_with_gw_hp": (26, 26, 40)}
# SNR floors (dB) of 2 ranks' gradients (2 sequences each) against one process's: accumulated over
# the same 2 micro-batches (measured: 53.9 dB under both recipes), and of one micro-batch of all 4
# sequences (measured: rowwise 51.8 dB, tensorwise 18.9 dB)
ACCUMULATED_FLOOR = 45
WHOLE_BATCH_FLOOR = {"rowwise": 45, "tensorwise": 16}
SMALL = [*SMALL_MODEL, "model.vocab_size=128", "device=cpu"]
# tensorwise on every map whose dims divide by 16: the attention's, not the feed-forward's (40 wide)
MIXED = [*SMALL, "model.ffn_dim=40", "model.fp8=tensorwise", "model.fp8_filter=all",
         "train.dtype=bf16"]


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    want, got = want.double(), got.double()
    return (10 * torch.log10(want.square().sum() / (got - want).square().sum())).item()


def converted(preset: str, recipe: str, fp8_filter: str = "auto") -> dict[str, set[str]]:
    """{layer index: the maps that convert} of a preset (built on the meta device)."""
    cfg = make_config_shared(f"model={preset}", f"model.fp8={recipe}",
                             f"model.fp8_filter={fp8_filter}")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    out: dict[str, set[str]] = {}
    short = {path: m for m, path in PATHS.items()}
    for row in map_precisions(model):
        if row.fp8:
            _, layer, *path = row.name.removesuffix(".weight").split(".")
            out.setdefault(layer, set()).add(short[".".join(path)])
    return out


@pytest.mark.parametrize("preset", sorted(AUTO))
def test_the_filter_converts_the_maps_torchao_thresholds_pick_on_every_preset(preset):
    for recipe in ("tensorwise", "rowwise"):
        cfg = make_config_shared(f"model={preset}")
        expected = set(AUTO[preset][recipe])
        found = converted(preset, recipe)
        assert found == ({str(i): expected for i in range(cfg.model.n_layers)} if expected
                         else {}), recipe
    # rowwise_with_gw_hp takes rowwise's thresholds; `all` converts every block map (all dims divide
    # by 16), an MoE layer's attention maps (its experts stay)
    assert converted(preset, "rowwise_with_gw_hp") == converted(preset, "rowwise")
    every = set(MAPS[:4]) if preset.startswith("moe") else set(MAPS)
    assert converted(preset, "tensorwise", "all") == {str(i): every
                                                      for i in range(cfg.model.n_layers)}


def test_the_maps_fp8_keep_names_stay_bf16_and_an_unknown_name_is_refused():
    cfg = make_config_shared("model=dense-tiny", "model.fp8=tensorwise", "model.fp8_filter=all",
                             "model.fp8_keep=[down,q]")
    with torch.device("meta"):
        rows = {r.name: r for r in map_precisions(Transformer(cfg.model, cfg.scale))}
    layers = range(cfg.model.n_layers)
    assert ({name for name, r in rows.items() if r.fp8}
            == {f"layers.{i}.{PATHS[m]}.weight" for i in layers for m in MAPS
                if m not in ("down", "q")})
    assert rows["layers.1.ffn.w_down.weight"].why == "model.fp8_keep names down"
    # the weights do not change: a checkpoint resumes with or without it
    assert "fp8_keep" not in cfg.model.architecture()
    with pytest.raises(ScalevecError, match=r"model.fp8_keep: unknown block maps \['w_down'\]"):
        make_config_shared("model=dense-tiny", "model.fp8_keep=[w_down]")


def test_no_other_matrix_converts_and_each_says_why():
    cfg = make_config_shared("model=moe-tiny", "model.tie_embeddings=false", "model.fp8=rowwise",
                             "model.fp8_filter=all")
    with torch.device("meta"):
        rows = {r.name: r for r in map_precisions(Transformer(cfg.model, cfg.scale))}
    kept = {name: r.why for name, r in rows.items() if not r.fp8}
    assert (kept["tok_emb.weight"].startswith("the embedding")
            and kept["head.weight"].startswith("the output head"))
    assert kept["layers.0.ffn.router.weight"] == "the router: scores in fp32"
    assert kept["layers.0.ffn.experts.w_gate"].startswith("an expert stack")
    assert kept["layers.0.ffn.shared.w_up.weight"].startswith("the shared expert")
    assert ({name for name, r in rows.items() if r.fp8}
            == {f"layers.{i}.{PATHS[m]}.weight" for i in range(4) for m in ("q", "k", "v", "o")})
    odd = make_config_shared("model=dense-tiny", "model.ffn_dim=40", "model.fp8=tensorwise",
                             "model.fp8_filter=all")
    with torch.device("meta"):
        rows = {r.name: r for r in map_precisions(Transformer(odd.model, odd.scale))}
    assert not rows["layers.0.ffn.w_up.weight"].fp8 and rows["layers.0.attn.wq.weight"].fp8
    assert rows["layers.0.ffn.w_up.weight"].why == ("40x256: a dim not divisible by 16, which the "
                                                    "FP8 matmul needs")


def small_model(*overrides: str) -> Transformer:
    cfg = make_config_shared(*SMALL, *overrides)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    return parallelize(model, cfg.distributed, CPU, seed=0, dtype=cfg.train.dtype)


def assert_maps_within_snr_floors(model: Transformer, tokens: torch.Tensor, recipe: str) -> None:
    """Each map's FP8 matmul on the inputs a bf16 forward of `tokens` gives it, against F.linear
    under the same autocast: the output, and the gradients of its input and weight for one output
    gradient, each within the recipe's SNR floor (also the GPU test's, on CUDA's own FP8 matmul)."""
    device = tokens.device
    inputs, matmuls = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.matmul is not F.linear
            matmuls[name] = m.matmul

            # what the map's matmul is given (gate and up: by project())
            def recorded(x, w, name=name):
                inputs[name] = x.detach()
                return matmuls[name](x, w)
            m.matmul = recorded
    with torch.autocast(device.type, dtype=torch.bfloat16):
        model(tokens)
    assert len(inputs) == 2 * len(MAPS)
    for name, x in inputs.items():
        linear = model.get_submodule(name)
        grad = torch.randn(*x.shape[:-1], linear.weight.shape[0], device=device,
                           generator=torch.Generator(device).manual_seed(1))
        results = []
        for matmul in (matmuls[name], F.linear):
            x_, w = x.clone().requires_grad_(), linear.weight.detach().clone().requires_grad_()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = matmul(x_, w)
            y.backward(grad.bfloat16())
            results.append((y, x_.grad, w.grad))
        (y, gx, gw), (y_ref, gx_ref, gw_ref) = results
        assert y.dtype == y_ref.dtype == torch.bfloat16 and gw.dtype == torch.float32
        for what, got, want, floor in zip(("output", "input grad", "weight grad"), (y, gx, gw),
                                          (y_ref, gx_ref, gw_ref), SNR_FLOOR[recipe], strict=True):
            assert snr_db(got, want) >= floor, (name, what, snr_db(got, want))


@pytest.mark.parametrize("scale", ["baseline", "unified"])
@pytest.mark.parametrize("recipe", sorted(SNR_FLOOR))
def test_every_converted_map_is_within_its_snr_floor_of_bf16(recipe, scale):
    model = small_model(f"scale={scale}", f"model.fp8={recipe}", "model.fp8_filter=all")
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    assert_maps_within_snr_floors(model, tokens, recipe)


def loss_and_grads(model: Transformer,
                   tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: full_value(p.grad).detach().clone()
                           for n, p in model.named_parameters()}


def test_activation_checkpointing_computes_what_keeping_every_activation_does():
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
    reference = loss_and_grads(small_model("scale=unified", "model.fp8=tensorwise",
                                           "model.fp8_filter=all"), tokens)
    for mode in ("selective", "full"):
        model = small_model("scale=unified", "model.fp8=tensorwise", "model.fp8_filter=all",
                            f"distributed.activation_checkpointing={mode}")
        loss, grads = loss_and_grads(model, tokens)
        assert torch.equal(loss, reference[0]), mode
        assert all(torch.equal(g, reference[1][n]) for n, g in grads.items()), mode


def test_compiled_blocks_trace_fp8_in_one_graph_and_match_eager():
    """fullgraph: a graph break is an error. AOT autograd's capture of forward and backward, without
    inductor's code generation (compile_backend); rowwise, whose casts scale along either dim."""
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
    fp8 = ["model.fp8=rowwise", "model.fp8_filter=all", "model.n_layers=1"]
    eager = loss_and_grads(small_model(*fp8), tokens)
    model = small_model(*fp8)
    torch._dynamo.reset()
    with compile_backend("aot_eager"):
        wrap_block(model.layers[0], "none", compile_block=True)
        loss, grads = loss_and_grads(model, tokens)
    torch._dynamo.reset()  # the graphs (and the fake tensors they hold) go with the model
    assert torch.allclose(loss, eager[0], rtol=1e-3)
    assert all(snr_db(g, eager[1][n]) > 30 for n, g in grads.items())


def _ranks(rank: int, world: int, store: str, out: str, recipe: str) -> None:
    with gloo_group(store, rank, world):
        model = small_model(f"model.fp8={recipe}", "model.fp8_filter=all", "train.dtype=bf16")
        tokens = torch.randint(0, 128, (4, 33),
                               generator=torch.Generator().manual_seed(0))[rank::world]
        loss, grads = loss_and_grads(model, tokens)
        replicated = replicated_params(model)
        reduce_replicated_grads(replicated)
        ids = {id(p) for p in replicated}
        grads.update({n: p.grad for n, p in model.named_parameters() if id(p) in ids})
        # each rank's own loss; FSDP's reduce-scatter averaged the gradients, the sites' all-reduce
        # theirs
        torch.save({"loss": loss, "grads": grads}, f"{out}/rank{rank}.pt")


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_two_gloo_ranks_compute_what_one_process_does(recipe, tmp_path):
    """Under FSDP2 (bf16 weights all-gathered: gloo has no FP8 collectives) against one process
    (bf16 autocast) on the same 4 sequences. Each rank's loss is what one process gives its 2
    sequences, and the averaged gradients what one process accumulates over them as 2 micro-batches;
    against the gradients of one micro-batch of all 4, rowwise stays close (it scales the gradient's
    columns over the tokens of a micro-batch), tensorwise within its bound (one scale per
    micro-batch's tensor)."""
    spawn(_ranks, (2, str(tmp_path / "store"), str(tmp_path), recipe))
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    model = small_model(f"model.fp8={recipe}", "model.fp8_filter=all", "train.dtype=bf16")
    halves = [loss_and_grads(model, tokens[rank::2])[0] for rank in range(2)]
    accumulated = {n: p.grad / 2 for n, p in model.named_parameters()}
    model.zero_grad()
    _, whole = loss_and_grads(model, tokens)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in range(2):
        assert torch.equal(ranks[rank]["loss"], halves[rank]), rank
        grads = ranks[rank]["grads"]
        assert all(snr_db(g, accumulated[n]) > ACCUMULATED_FLOOR for n, g in grads.items()), rank
        assert all(snr_db(g, whole[n]) > WHOLE_BATCH_FLOOR[recipe] for n, g in grads.items()), rank


def test_the_default_path_never_imports_torchao_and_fp8_without_it_says_how_to_install(monkeypatch):
    hide_package(monkeypatch, "torchao")
    model = small_model()
    assert all(m.matmul is F.linear for m in model.modules() if isinstance(m, Linear))
    with pytest.raises(ScalevecError,
                       match=r"model.fp8: needs torchao.*pip install torchao==0.18.0"):
        small_model("model.fp8=rowwise")


def test_fp8_diagnostics_are_the_casts_and_gradients_computed_here():
    """map_input_stats' FP8 shares against torch's own float8 cast of each input with tensorwise's
    scale (the format's largest value over the input's amax), and fp8_grad_snr against the gradients
    of a second model with the same weights and no FP8."""
    model = small_model("model.fp8=tensorwise", "model.fp8_filter=all")
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
    inputs, matmuls = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            matmuls[name] = m.matmul
            m.matmul = lambda x, w, name=name: (inputs.__setitem__(name, x.detach()),
                                                matmuls[name](x, w))[1]
    with torch.no_grad():
        model(tokens[:, :-1])
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            m.matmul = matmuls[name]
    got = map_input_stats(model, tokens[:, :-1], None, nullcontext)
    assert len(inputs) == 14 and len(got) == 4 * 14
    e4m3 = torch.finfo(torch.float8_e4m3fn).max
    for name, x in inputs.items():
        key = "diag/layer" + name.removeprefix("layers.").replace(".", "/", 1)
        fp8 = (x * (e4m3 / x.abs().max())).to(torch.float8_e4m3fn).float()
        got_ = {k.removeprefix(key + "/"): float(v) for k, v in got.items()
                if k.startswith(key + "/")}
        assert got_["fp8_underflow"] == pytest.approx(float(((fp8 == 0) & (x != 0)).sum()
                                                            / (x != 0).sum()), abs=1e-6)
        assert got_["fp8_saturated"] == pytest.approx(float((fp8.abs() == e4m3).float().mean()),
                                                      abs=1e-6)
        assert got_["fp8_saturated"] > 0  # the amax itself
        assert got_["in_max_rms"] == pytest.approx(float(x.abs().max() / x.square().mean().sqrt()),
                                                   rel=1e-5)
    snr = fp8_grad_snr(model, tokens[:, :-1], tokens[:, 1:], None,
                       partial(torch.autocast, "cpu", dtype=torch.bfloat16))
    assert all(p.grad is None for p in model.parameters())  # dropped after
    reference = small_model()
    reference.load_state_dict(model.state_dict())
    _, fp8_grads = loss_and_grads(model, tokens)
    _, bf16_grads = loss_and_grads(reference, tokens)
    for name in inputs:
        key = "diag/layer" + name.removeprefix("layers.").replace(".", "/", 1) + "/fp8_grad_snr_db"
        weight = f"{name}.weight"
        assert float(snr[key]) == pytest.approx(snr_db(fp8_grads[weight], bf16_grads[weight]),
                                                rel=1e-4), key


def _gathered_in_fp8(rank: int, world: int, store: str, out: str) -> None:
    with gloo_group(store, rank, world):
        cfg = make_config_shared(*MIXED, world_size=world)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.scale)
        convert_fp8(model, CPU, all_gather=True)  # what parallelize does on NCCL
        model = parallelize(model, cfg.distributed, CPU, seed=0, dtype=cfg.train.dtype)
        weights = gathered_in_fp8(model)
        tokens = torch.randint(0, 128, (4, 33),
                               generator=torch.Generator().manual_seed(0))[rank::world]
        loss, _ = loss_and_grads(model, tokens)
        precompute_scales(weights)
        scales = {n: p._local_tensor._precomputed_scale for n, p in model.named_parameters()
                  if any(p is w for w in weights)}
        full = {n: full_value(p.detach()) for n, p in model.named_parameters() if n in scales}
        torch.save({"loss": loss, "scales": scales, "full": full}, f"{out}/rank{rank}.pt")


def test_tensorwise_weights_all_gathered_in_fp8_and_their_scales_precomputed(tmp_path):
    """The NCCL path on 2 gloo ranks, whose all-gather takes FP8 where a block's group also holds
    weights of another dtype (gloo has no FP8 collectives): here the feed-forward's, 40 wide, which
    stay bf16. Each rank's loss is that of the bf16 all-gather within FP8's error (the gathered
    weight is cast from the fp32 shard, not from its bf16 copy), and precompute_scales gives every
    FP8 weight the scale of its whole value: the format's largest magnitude over the weight's
    amax."""
    spawn(_gathered_in_fp8, (2, str(tmp_path / "store"), str(tmp_path)))
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    model = small_model(*MIXED[len(SMALL):])
    e4m3 = torch.finfo(torch.float8_e4m3fn).max
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        want, _ = loss_and_grads(model, tokens[rank::2])
        assert torch.allclose(got["loss"], want, rtol=2e-3), rank
        assert sorted(got["scales"]) == sorted(f"layers.{i}.{PATHS[m]}.weight" for i in range(2)
                                               for m in ("q", "k", "v", "o"))
        for name, scale in got["scales"].items():
            assert torch.allclose(scale, e4m3 / got["full"][name].abs().max().float(),
                                  rtol=1e-6), name

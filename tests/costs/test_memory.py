"""The memory estimate (scalevec_train/costs/memory.py, activations.py) against bytes measured on a
real CPU step: the tensors autograd saves during a forward (saved-tensor hooks, unique storages,
plus what selective checkpointing caches), and the parameters, gradients and optimizer state after
an optimizer step (taken as the trainer takes it, with the copies it keeps to undo a skipped step
where the optimizer cannot skip it itself). Then the GPU recipes against an 80 GB device at 8 ranks,
and describe's report."""

import gc
import json

import pytest
import torch

from scalevec_train.costs.memory import GB, estimate, fix
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.parallel.fp8 import convert as convert_fp8
from scalevec_train.parallel.wrap import wrap_block
from scalevec_train.run.build import autocast_for
from scalevec_train.training.skip import ConditionalStep
from scalevec_train.training.trainer import cross_entropy
from tests.support.helpers import make_configs

SHAPE = ["train.micro_batch=2", "train.global_batch=2", "train.seq_len=64"]


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def live_storages() -> dict[int, torch.UntypedStorage]:
    """The storages of every tensor alive in this process, by address. A wrapper subclass (a DTensor
    that an earlier test in this pytest worker left alive, whichever files it happened to run) has
    no storage of its own to read: its local tensors are listed themselves."""
    out = {}
    for t in gc.get_objects():
        if issubclass(type(t), torch.Tensor):
            try:
                storage = t.untyped_storage()
                out[storage.data_ptr()] = storage
            # a fake tensor (a compiled graph an earlier test keeps) has no storage to read
            except RuntimeError:
                continue
    return out


def measure(cfg, states: bool = True) -> dict[str, int]:
    """Bytes of one real training step on the CPU: activations (what the saved-tensor hooks see, and
    the tensors made during the forward that are still alive after it: selective checkpointing's
    cache of matmul outputs, which no hook sees), the saved tensors per block when the blocks are
    not checkpointed, and with `states` parameters, gradients, optimizer state, the skip's copies
    (the backward and two optimizer steps: the forward alone without)."""
    torch.manual_seed(0)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    convert_fp8(model, torch.device("cpu"), all_gather=False)
    for block in model.layers:
        wrap_block(block, cfg.distributed.activation_checkpointing, False)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved, layer, per_layer = {}, [None], {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights and st.data_ptr() not in saved:
            saved[st.data_ptr()] = st.nbytes()
            if layer[0] is not None:
                per_layer[layer[0]] = per_layer.get(layer[0], 0) + st.nbytes()
        return t

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda *_, i=i: layer.__setitem__(0, i))
    model.final_norm.register_forward_pre_hook(lambda *_: layer.__setitem__(0, None))
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len + 1))
    autocast = autocast_for(cfg.train.dtype, torch.device("cpu"))
    # `before` holds every storage alive now until the forward is measured: an earlier test's
    # garbage that the collector frees during the forward would otherwise give its address to a new
    # tensor, which would then be taken for one that existed before
    gc.collect()
    before = live_storages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    cached = {k: s.nbytes() for k, s in live_storages().items()
              if k not in before and k not in saved and k not in weights}
    del before
    activations = {"activations": sum(saved.values()) + sum(cached.values()),
                   "block": max(per_layer.values(), default=0)}
    if not states:
        return activations
    loss.backward()
    optimizer = build_optimizer(model, cfg.optim)
    step = ConditionalStep(optimizer, model)
    for _ in range(2):  # the first step creates the optimizer state, the second keeps its copies
        step(torch.tensor(True))
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {**activations,
            "params": storage_bytes(model.parameters()),
            "grads": storage_bytes(p.grad for p in model.parameters()),
            "optimizer": storage_bytes(state), "skip_copies": storage_bytes(step.copies.values())}


def close(estimated: float, measured: float, rel: float = 0.10) -> bool:
    return abs(estimated - measured) <= rel * measured


@pytest.mark.parametrize("model", ["dense-tiny", "moe-tiny"])
@pytest.mark.parametrize("scale", ["baseline", "unified"])
def test_estimate_matches_a_real_cpu_step(model, scale):
    """Within 10% of the measured bytes for each checkpointing mode and each optimizer
    (AdamW, Muon): `none` keeps every block's tensors, `selective` the blocks' inputs and matmul
    outputs, `full` only the blocks' inputs (both recompute one block in its backward; `full`'s is
    the largest block measured without checkpointing). Parameters, gradients and optimizer state do
    not depend on the mode: measured once per optimizer (`none`), each mode's estimate of them is
    checked against that. The forward does not depend on the optimizer (the two configs agree on all
    it reads): the checkpointing modes' activations are measured once, for both."""
    base = [f"model={model}", f"scale={scale}", *SHAPE]
    optims = ("adamw", "muon")
    measured = {}
    for mode in ("none", "selective", "full"):
        cfgs = dict(zip(optims, make_configs([[*base, f"optim={optim}",
                                               f"distributed.activation_checkpointing={mode}"]
                                              for optim in optims])))
        adamw, muon = cfgs.values()
        assert ((adamw.model, adamw.scale, adamw.train, adamw.distributed)
                == (muon.model, muon.scale, muon.train, muon.distributed))
        if mode == "none":
            measured[mode] = {optim: measure(cfg) for optim, cfg in cfgs.items()}
        else:
            forward = measure(adamw, states=False)
            measured[mode] = {optim: {**measured["none"][optim], **forward} for optim in optims}
        for optim, cfg in cfgs.items():
            got, est = measured[mode][optim], estimate(cfg, world=1, device="cpu")
            for key in ("params", "grads", "optimizer", "skip_copies", "activations"):
                assert close(getattr(est, key), got[key]), (mode, optim, key, getattr(est, key),
                                                            got[key])
            if mode == "none":
                assert est.recompute == 0
            else:
                block = measured["none"][optim]["block"]
                assert close(est.recompute, block), (optim, est.recompute, block)


@pytest.mark.parametrize("overrides", [
    ["model=dense-tiny-gemma", "scale=unified"],  # QK-norm and post-norms under DNP
    ["model=dense-tiny", "scale=dp", "scale.targets=[q,k,v,o,gate,up,down]", "scale.reparam=er"],
    # sites folded into experts
    ["model=moe-tiny", "scale=dp", "scale.targets=[q,k,v,o,gate,up,down]"],
    ["model=moe-tiny", "scale=unified", "scale.per_expert=true"],
])
def test_estimate_matches_other_strategies(overrides):
    cfg = make_configs([[*overrides, *SHAPE]])[0]
    got, est = measure(cfg, states=False), estimate(cfg, world=1, device="cpu")
    assert close(est.activations, got["activations"]), (est.activations, got["activations"])


@pytest.mark.parametrize("model", ["dense-tiny", "moe-tiny"])
@pytest.mark.parametrize("scale", ["baseline", "unified"])
def test_estimate_matches_under_bf16_autocast(model, scale):
    """train.dtype=bf16 on the CPU: the matmuls keep bf16 casts of their fp32 inputs and of the
    weights, as on one GPU (whose norms are the fused kernels instead)."""
    cfg = make_configs([[f"model={model}", f"scale={scale}", *SHAPE, "train.dtype=bf16"]])[0]
    got, est = measure(cfg, states=False), estimate(cfg, world=1, device="cpu")
    assert close(est.activations, got["activations"]), (est.activations, got["activations"])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_estimate_matches_under_fp8(recipe):
    """model.fp8 on one process keeps what bf16 autocast keeps: the FP8 matmul saves its bf16 input
    and weight, and casts them to FP8 again in the backward, so the estimate is bf16's."""
    cfg = make_configs([["model=dense-tiny", "scale=unified", *SHAPE, "train.dtype=bf16",
                         f"model.fp8={recipe}", "model.fp8_filter=all"]])[0]
    got, est = measure(cfg, states=False), estimate(cfg, world=1, device="cpu")
    assert close(est.activations, got["activations"]), (est.activations, got["activations"])


def test_fp8_all_gather_gathers_the_converted_maps_in_one_byte():
    """dense-1b on 8 ranks under tensorwise: FSDP gathers the maps torchao's thresholds convert (q,
    o: 2048 x 2048; gate, up, down: 2048 x 8192; not k, v: 512 x 2048) in FP8, 1 byte instead of
    bf16's 2, in both blocks it holds gathered; rowwise gathers bf16. Nothing else changes."""
    none, tensorwise, rowwise = (estimate(cfg, world=8) for cfg in make_configs(
        [["model=dense-1b", f"model.fp8={recipe}"] for recipe in ("none", "tensorwise", "rowwise")],
        8))
    assert none.fsdp_buffers - tensorwise.fsdp_buffers == 2 * (2 * 2048 * 2048 + 3 * 2048 * 8192)
    assert rowwise == none
    assert ({k: v for k, v in tensorwise.as_dict().items() if k not in ("fsdp_buffers", "total")}
            == {k: v for k, v in none.as_dict().items() if k not in ("fsdp_buffers", "total")})


def test_checkpointing_and_micro_batch_shrink_the_estimate():
    """The orders an estimate must respect: full < selective < none for activations, activations
    linear in the micro-batch, states divided by the ranks."""
    overrides = ["model=dense-1b"]
    by_mode = {mode: estimate(
        make_configs([[*overrides, f"distributed.activation_checkpointing={mode}"]], 8)[0], world=8)
        for mode in ("none", "selective", "full")}
    assert (by_mode["full"].activations < by_mode["selective"].activations
            < by_mode["none"].activations)
    half = estimate(make_configs([[*overrides, "train.max_micro_batch_tokens=8192"]], 8)[0],
                    world=8)
    assert half.micro_batch_tokens * 2 == by_mode["none"].micro_batch_tokens
    assert close(half.activations * 2, by_mode["none"].activations, rel=1e-6)
    one = estimate(make_configs([overrides], 1)[0], world=1)
    assert one.params == pytest.approx(8 * by_mode["none"].params, rel=1e-3)


GPU_RECIPES = ["dense-0.12b", "dense-0.5b", "dense-gemma-0.5b", "dense-1b", "dense-2b", "moe-0.5b",
               "moe-2b"]


@pytest.mark.parametrize("model", GPU_RECIPES)
@pytest.mark.parametrize("scale", ["baseline", "unified"])
@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_gpu_recipes_fit_80gb_at_8_ranks(model, scale, optim):
    """Every GPU recipe, with its default micro-batch and checkpointing, under the default strategy
    and the heaviest one (unified), fits an 80 GB GPU at 8 ranks."""
    cfg = make_configs([[f"model={model}", f"scale={scale}", f"optim={optim}"]], 8)[0]
    est = estimate(cfg, world=8)
    assert est.total <= 80 * GB, (model, est.as_dict())
    assert fix(cfg, 8, 80 * GB) is None


def test_describe_reports_memory_with_a_verdict_and_a_fix(capsys):
    """describe's JSON carries the breakdown and the verdict; a config that does not fit names the
    change that makes it fit, and that change does."""
    from scalevec_train.describe import main

    assert main(["model=dense-2b", "world_size=1", "device_gb=80", "format=json"]) == 0
    m = json.loads(capsys.readouterr().out)["memory"]
    parts = ("params", "grads", "accumulated_grads", "optimizer", "activations", "logits",
             "overhead")
    assert m["total"] >= sum(m[k] for k in parts) and m["world_size"] == 1
    assert not m["fits"] and m["fix"] == "distributed.activation_checkpointing=selective"
    assert 1 not in m["fits_world_sizes"] and 8 in m["fits_world_sizes"]
    modes = m["by_checkpointing"]
    assert modes["none"]["total"] == m["total"] and modes["selective"]["total"] <= 80 * GB
    assert (modes["full"]["activations"] < modes["selective"]["activations"]
            < modes["none"]["activations"])
    fixed = make_configs([["model=dense-2b", "distributed.activation_checkpointing=selective"]])[0]
    assert estimate(fixed, world=1).total <= 80 * GB
    assert main(["model=dense-tiny", "world_size=0"]) == 2
    assert "world_size" in capsys.readouterr().err
    # a batch that does not split over the ranks: the sites are described, the memory says why not
    assert main(["model=dense-tiny", "train.global_batch=12", "world_size=8", "format=json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["sites"] and "cannot be split evenly over 8 ranks" in d["memory"]["error"]

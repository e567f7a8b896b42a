"""One precision regime (docs/concepts/architecture.md, "Precision"): train.dtype=bf16 on one
process (autocast) and on 2 gloo ranks (autocast + FSDP2 bf16 mixed precision) hand the fused ops
the same dtypes, call by call, for dense and MoE models under baseline and unified: the residual
stream and every activation bf16, every scale fp32, the outputs bf16, and the same dtypes saved for
the backward.

The record comes from the real ops: each fused op the model calls (rms_norm_scales, head_rms_norm,
swiglu_norm; on CPU their PyTorch paths) is wrapped where the model looks it up, and notes the
dtypes of its tensor arguments, of its outputs, and of the tensors autograd saves inside it.
"""

import contextlib

import torch

import scalevec_train.model.layers as layers
import scalevec_train.model.moe as moe
import scalevec_train.model.swiglu as swiglu
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.run.build import autocast_for
from scalevec_train.training.trainer import cross_entropy
from tests.support.helpers import make_config
from tests.support.launch import gloo_group, spawn
from tests.support.parallel import site_values
from tests.support.presets import SMALL_MODEL

SMALL = [*SMALL_MODEL, "model.vocab_size=128", "train.dtype=bf16", "device=cpu",
         "train.micro_batch=8"]
MOE = ["model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=32"]
CASES = {
    "dense-baseline": ["scale=baseline"],
    "dense-unified": ["scale=unified"],
    "moe-baseline": [*MOE, "scale=baseline"],
    "moe-unified": [*MOE, "scale=unified"],
}
# Where the model looks each fused op up.
FUSED = [(layers, "rms_norm_scales"), (layers, "head_rms_norm"), (swiglu, "swiglu_norm"),
         (moe, "rms_norm_scales")]
# Which arguments of each op are scales (the others that are floating point are activations).
SCALE_ARGS = {"rms_norm_scales": {1}, "head_rms_norm": {1}, "swiglu_norm": {2, 3}}
BF16, FP32 = torch.bfloat16, torch.float32


def _dtypes(value):
    """The dtypes of the tensors in value (nested lists and tuples kept, other values dropped)."""
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, list | tuple):
        return tuple(_dtypes(v) for v in value)
    return None


@contextlib.contextmanager
def recording(log: list):
    """Wrap the fused ops the model calls; each call appends (op, argument dtypes, output dtypes,
    dtypes of the tensors saved for the backward)."""
    originals = [(module, name, getattr(module, name)) for module, name in FUSED]

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            saved = []

            def pack(t):
                saved.append(t.dtype)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(*args, **kwargs)
            log.append((name, _dtypes(args), _dtypes(kwargs.get("residual")), _dtypes(out),
                        tuple(saved)))
            return out
        return recorded

    for module, name, fn in originals:
        setattr(module, name, wrap(name, fn))
    try:
        yield
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def run_case(case: str, world: int) -> dict:
    """One forward and backward of `case` as training runs it (parallelize, autocast_for, the
    trainer's loss), with every fused-op call recorded."""
    cfg = make_config(*SMALL, *CASES[case], world_size=world)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    model = parallelize(model, cfg.distributed, torch.device("cpu"), seed=0, dtype=cfg.train.dtype)
    site_values(model)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    log = []
    with recording(log), autocast_for(cfg.train.dtype, torch.device("cpu"))():
        logits = model(tokens[:, :-1])
        loss = cross_entropy(logits, tokens[:, 1:])
    loss.backward()
    return {"calls": log, "logits": logits.dtype}


def _rank(rank: int, world: int, store: str, out: str) -> None:
    with gloo_group(store, rank, world):
        torch.save({case: run_case(case, world) for case in CASES}, f"{out}/rank{rank}.pt")


def check_design(case: str, calls: list) -> None:
    """What the design says at each fused-op boundary: activations in and out bf16, scales fp32; a
    saved floating-point tensor is bf16 (an activation) or fp32 (a scale, a statistic, a row
    normalized in fp32)."""
    assert calls, case
    ops = {name for name, *_ in calls}
    assert "rms_norm_scales" in ops and ("unified" not in case or "swiglu_norm" in ops), (case, ops)
    for name, args, residual, outs, saved in calls:
        tensors = [(i, d) for i, d in enumerate(args) if d is not None]
        for i, d in tensors:
            want = FP32 if i in SCALE_ARGS[name] else BF16
            if isinstance(d, tuple):
                assert all(x in (want, None) for x in d), (case, name, i, d)
            elif d.is_floating_point:
                assert d == want, (case, name, i, d)
        assert residual in (None, BF16), (case, name, residual)
        assert set(outs if isinstance(outs, tuple) else (outs,)) == {BF16}, (case, name, outs)
        # the others are indices (a row's expert)
        floats = {d for d in saved if d.is_floating_point}
        assert floats <= {BF16, FP32} and FP32 in floats, (case, name, saved)


def test_one_process_and_fsdp_train_in_one_regime(tmp_path):
    one = {case: run_case(case, 1) for case in CASES}
    for case, result in one.items():
        check_design(case, result["calls"])
        assert result["logits"] == BF16
    spawn(_rank, (2, str(tmp_path / "store"), str(tmp_path)))
    for rank in range(2):
        sharded = torch.load(tmp_path / f"rank{rank}.pt")
        for case in CASES:
            assert sharded[case]["calls"] == one[case]["calls"], (rank, case)
            assert sharded[case]["logits"] == BF16

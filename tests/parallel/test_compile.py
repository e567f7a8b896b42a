"""torch.compile of the blocks (distributed.compile=true; inductor on CPU needs only a C compiler).

Every block compiles as one graph (wrap_block compiles with fullgraph=True: a graph break fails) under
every strategy preset in configs/scale/, dense and MoE; checkpointed (selective and full) under unified;
under unified also on the fused ops' fake implementations (model.kernels=triton, in a
child process whose triton interprets the kernels). Then compiled training matches eager training for
dense-tiny and moe-tiny, baseline and unified, AdamW and Muon, the training loss compiled too: with
inductor for dense-tiny under unified and moe-tiny under baseline, with aot_eager for the other two.

Graph breaks are dynamo's verdict, so the preset matrix traces with its `eager` backend; checkpointing
and the fused ops trace with `aot_eager` (AOT autograd traces the backward, through the ops' fake
implementations and the checkpoint policies); only the training comparison pays for inductor, in two of
its four cases.
"""

from functools import partial

import pytest
import torch

from scalevec_kernels.backend import INTERPRETED
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.parallel.wrap import wrap_block
from scalevec_train.training.trainer import training_loss
from tests.helpers import REPO, make_config
from tests.kernels.helpers import run_interpreted
from tests.launch import compile_backend

PRESETS = sorted(p.stem for p in (REPO / "configs" / "scale").glob("*.yaml"))
TINY = ["model.dim=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=48", "model.n_layers=1",
        "model.vocab_size=128"]
MODELS = {"dense": [], "moe": ["model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=16"]}
STEPS = 3


def tiny(overrides: list[str]) -> Transformer:
    cfg = make_config(*TINY, *overrides)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    return model


def compiled_step(model: Transformer, ac: str, backend: str) -> None:
    """One forward and backward with every block checkpointed (`ac`) and compiled by wrap_block, with
    `backend` in place of inductor."""
    torch._dynamo.reset()
    compile_ = torch.compile
    try:
        torch.compile = partial(compile_, backend=backend)
        for block in model.layers:
            wrap_block(block, ac, compile_block=True)
    finally:
        torch.compile = compile_
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.layers.parameters())


@pytest.mark.parametrize("family", sorted(MODELS))
def test_every_strategy_compiles_each_block_as_one_graph(family):
    # Presets that differ only in how the optimizer treats sites (iwd, wd_all) build the same block, so
    # the same graph: each distinct block is traced once.
    blocks = {}
    for preset in PRESETS:
        model = tiny([*MODELS[family], f"scale={preset}"])
        blocks.setdefault(repr(model), model)
    assert len(blocks) >= len(PRESETS) - 2
    for model in blocks.values():
        compiled_step(model, "none", "eager")


@pytest.mark.parametrize("ac", ["selective", "full"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_checkpointed_blocks_compile_as_one_graph(family, ac):
    # unified has every kind of site and fused op; what checkpointing adds (the MoE layer's recorded
    # state inside a checkpointed region, the selective policy) is the same under every strategy.
    compiled_step(tiny([*MODELS[family], "scale=unified"]), ac, "aot_eager")


if INTERPRETED:

    # The MoE block's fused op sees data-dependent row counts; the selective policy meets the fused ops
    # in the dense block the same way as in the MoE one.
    @pytest.mark.parametrize("family,ac", [("dense", "selective"), ("moe", "none")])
    def test_interp_blocks_compile_as_one_graph_on_the_fused_ops(family, ac):
        compiled_step(tiny([*MODELS[family], "scale=unified", "model.kernels=triton"]), ac, "aot_eager")

else:

    def test_blocks_compile_as_one_graph_on_the_fused_ops():
        run_interpreted(__file__)


def train(model: Transformer, overrides: list[str], optim: str) -> list[float]:
    """Losses of a few steps from the initial weights (re-initialized: one model serves both optimizers,
    so a compiled model is compiled once), with the trainer's loss, compiled with the blocks."""
    cfg = make_config(*overrides, f"optim={optim}")
    loss_fn = training_loss(cfg.distributed.compile)
    model.init_weights(0)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        aux = model.auxiliary_loss()
        (loss if aux is None else loss + aux).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.discard_step_state()
        losses.append(loss.item())
    return losses




# Measured on the 2-core CPU (torch 2.13): compiled against eager, the losses differ by at most 9e-7
# relative under AdamW and 1.7e-5 under Muon. Inductor fuses element-wise work and reorders reductions,
# which moves each result by fp32 rounding (~1e-7 relative); AdamW's normalized steps carry that along,
# while Muon orthogonalizes each matrix's gradient, scaling its smallest singular directions (where
# rounding weighs most) up to unit size, which amplifies the differences about tenfold a step. A block
# that computes anything else (a site or a norm missing) moves these losses by 1e-2 or more.
TOLERANCE = {"adamw": 1e-5, "muon": 1e-4}


# Inductor for one dense and one MoE model, unified on the dense one (every kind of site), baseline on the
# MoE one (its experts' loop): on a fresh machine its code generation (a C++ compile per fused kernel, no
# cache yet) was most of this file's time, about 2 minutes of CPU per case. The other two pairs compile
# with aot_eager: dynamo's graphs and AOT autograd's forward and backward, which inductor lowers, trained
# against eager with the same tolerances. Inductor's C++ here is scalar (cpp.vec_isa_ok off): the
# vectorized kernels' headers were a third of a case's time, and no user trains with inductor's CPU code
# (on a GPU it writes Triton, tests/gpu); the lowering, fusions and the fused ops' registrations are the same.
CASES = [("dense-tiny", "unified", "inductor"), ("moe-tiny", "baseline", "inductor"),
         ("dense-tiny", "baseline", "aot_eager"), ("moe-tiny", "unified", "aot_eager")]


@pytest.mark.parametrize("model,scale,backend", CASES)
def test_compiled_training_matches_eager(model, scale, backend):
    """distributed.compile=true (blocks and loss) against eager, fp32 on CPU; each model compiles once and
    trains with both optimizers (4 experts instead of moe-tiny's 8: the per-expert loop unrolls into the
    graph, and compile time grows with it)."""
    overrides = [f"model={model}", f"scale={scale}", "model.n_layers=2", "model.vocab_size=128", "optim.lr=1e-3"]
    if model == "moe-tiny":
        overrides.append("model.moe.num_experts=4")
    results = {}
    for compiled in (False, True):
        cfg = make_config(*overrides, f"distributed.compile={str(compiled).lower()}")
        with torch.device("meta"):
            net = Transformer(cfg.model, cfg.scale)
        with compile_backend(None if backend == "inductor" else backend), \
                torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
            net = parallelize(net, cfg.distributed, torch.device("cpu"), seed=0, dtype=cfg.train.dtype)
            results[compiled] = {optim: train(net, [*overrides, f"distributed.compile={str(compiled).lower()}"],
                                              optim) for optim in TOLERANCE}
    torch._dynamo.reset()
    for optim, eager in results[False].items():
        assert results[True][optim] == pytest.approx(eager, rel=TOLERANCE[optim]), optim
        assert eager[0] - eager[-1] > 0.4  # the steps moved the model

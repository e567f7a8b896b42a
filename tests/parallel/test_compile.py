"""torch.compile of the blocks (distributed.compile=true; inductor on CPU needs only a C compiler).

Every block compiles as one graph (wrap_block compiles with fullgraph=True: a graph break fails)
under every strategy preset in configs/scale/, dense and MoE; checkpointed (selective and full)
under unified, where the loss, the token counts and every gradient must be eager's without
checkpointing and the backward graph must recompute what the mode promises; under unified also on
the fused ops' fake implementations (model.kernels=triton, in a child process whose triton
interprets the kernels). Then compiled training matches eager training for dense-tiny and moe-tiny,
baseline and unified, AdamW and Muon, the training loss compiled too: with inductor for dense-tiny
under unified (its blocks checkpointed selectively) and moe-tiny under baseline, with aot_eager for
the other two.

Graph breaks are dynamo's verdict, so the preset matrix traces with its `eager` backend;
checkpointing and the fused ops trace with `aot_eager` (AOT autograd traces the backward, through
the ops' fake implementations and the checkpoint policies), or with KeptGraphs, aot_eager that keeps
the graphs; only the training comparison pays for inductor, in two of its four cases.
"""

from collections import Counter
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from scalevec_kernels.backend import INTERPRETED
from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.parallel.wrap import wrap_block
from scalevec_train.training.trainer import training_loss
from tests.support.helpers import REPO, make_config
from tests.support.launch import compile_backend

PRESETS = sorted(p.stem for p in (REPO / "configs" / "scale").glob("*.yaml"))
TINY = ["model.dim=32", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=48",
        "model.n_layers=1", "model.vocab_size=128"]
MODELS = {"dense": [],
          "moe": ["model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=16"]}
STEPS = 3
aten = torch.ops.aten


def tiny(overrides: list[str]) -> Transformer:
    cfg = make_config(*TINY, *overrides)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    return model


def compiled_step(model: Transformer, ac: str, backend: str) -> None:
    """One forward and backward with every block checkpointed (`ac`) and compiled by wrap_block,
    with `backend` in place of inductor."""
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
    # Presets that differ only in how the optimizer treats sites (iwd, wd_all) build the same block,
    # so the same graph: each distinct block is traced once.
    blocks = {}
    for preset in PRESETS:
        model = tiny([*MODELS[family], f"scale={preset}"])
        blocks.setdefault(repr(model), model)
    assert len(blocks) >= len(PRESETS) - 2
    for model in blocks.values():
        compiled_step(model, "none", "eager")


class KeptGraphs:
    """A torch.compile backend that counts the ops of the forward and backward graphs AOT autograd
    partitions (inductor's partitioner, min-cut rematerialization, with no code generation after it,
    as aot_eager): what the backward recomputes shows in its graph."""

    def __init__(self):
        self.forward, self.backward = Counter(), Counter()
        self.forwards = 0
        self.backend = aot_autograd(fw_compiler=partial(self.keep, self.forward),
                                    bw_compiler=partial(self.keep, self.backward),
                                    partition_fn=min_cut_rematerialization_partition,
                                    keep_inference_input_mutations=True)

    def keep(self, ops: Counter, graph: torch.fx.GraphModule, example_inputs) -> Callable:
        self.forwards += ops is self.forward
        ops.update(node.target for node in graph.graph.nodes if node.op == "call_function")
        return make_boxed_func(graph.forward)


def matmuls(ops: Counter) -> int:
    return sum(ops[op] for op in (aten.mm.default, aten.addmm.default, aten.bmm.default))


def loss_and_grads(model: Transformer) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The training loss (cross-entropy and the routers' losses) and every gradient of one step; the
    experts' token counts."""
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    aux = model.auxiliary_loss()
    (loss if aux is None else loss + aux).backward()
    counts = [m.token_counts for m in model.modules() if isinstance(m, MoEFeedForward)]
    return [loss.detach(), *([] if aux is None else [aux.detach()]), *counts], \
        {n: p.grad for n, p in model.named_parameters()}


# unified has every kind of site and fused op; what checkpointing adds (the MoE layer's recorded
# state inside a checkpointed region, the selective policy) is the same under every strategy. The
# routers' load-balancing loss on: it reads the recorded counts.
@pytest.mark.parametrize("ac", ["selective", "full"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_checkpointed_blocks_compile_as_one_graph_and_match_eager(family, ac):
    """wrap_block's compiled (fullgraph) and checkpointed block against the eager model without
    checkpointing, fp32: the same losses, token counts and gradients (AOT autograd's graphs run
    eager's kernels, so a recomputation that computes what the forward did changes no bit; measured:
    equal on torch 2.13). Then what the backward graph recomputes: under selective none of the
    forward's matrix multiplies (only the two per multiply that its gradients take) but the norms
    (their rsqrt); under full every multiply but at most one per block (one whose output the
    backward does not read). A policy that saves the wrong op computes the same numbers; only the
    backward's graph shows it."""
    overrides = [*MODELS[family], "scale=unified",
                 *(["model.moe.aux_loss_coef=0.01"] if family == "moe" else [])]
    want_values, want = loss_and_grads(tiny(overrides))
    model, graphs = tiny(overrides), KeptGraphs()
    torch._dynamo.reset()
    with compile_backend(graphs.backend):
        for block in model.layers:
            wrap_block(block, ac, compile_block=True)
    values, grads = loss_and_grads(model)
    assert graphs.forwards == len(model.layers)
    for got, value in zip(values, want_values, strict=True):
        torch.testing.assert_close(got, value, rtol=1e-6, atol=0)
    assert grads.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=0, msg=name)
    forward, backward = matmuls(graphs.forward), matmuls(graphs.backward)
    assert forward >= 4 * len(model.layers)  # q, k, v and o at least
    if ac == "selective":
        assert backward == 2 * forward, (forward, backward)
        assert graphs.backward[aten.rsqrt.default] == graphs.forward[aten.rsqrt.default] > 0
    else:
        assert backward >= 3 * forward - len(model.layers), (forward, backward)


if INTERPRETED:

    # The MoE block's fused op sees data-dependent row counts; the selective policy meets the fused
    # ops in the dense block the same way as in the MoE one.
    @pytest.mark.parametrize("family,ac", [("dense", "selective"), ("moe", "none")])
    def test_interp_blocks_compile_as_one_graph_on_the_fused_ops(family, ac):
        compiled_step(tiny([*MODELS[family], "scale=unified", "model.kernels=triton"]), ac,
                      "aot_eager")


def train(model: Transformer, overrides: list[str], optim: str) -> list[float]:
    """Losses of a few steps from the initial weights (re-initialized: one model serves both
    optimizers, so a compiled model is compiled once), with the trainer's loss, compiled with the
    blocks."""
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




# Measured on the 2-core CPU (torch 2.13), with 2 blocks: compiled against eager, the losses
# differed by at most 9e-7 relative under AdamW and 1.7e-5 under Muon; on 2026-11-28 by at most
# 2.7e-6 and 3.8e-6 (the dense inductor case, the same to the bit with or without its selective
# checkpointing; the MoE inductor case 1.9e-7 and 1.5e-6; the aot_eager cases equal to the bit).
# Inductor fuses element-wise work and reorders reductions, which moves each result by fp32 rounding
# (~1e-7 relative); AdamW's normalized steps carry that along, while Muon orthogonalizes each
# matrix's gradient, scaling its smallest singular directions (where rounding weighs most) up to
# unit size, which amplifies the differences up to tenfold a step. A block that computes anything
# else (a site or a norm missing) moves these losses by 1e-2 or more.
TOLERANCE = {"adamw": 1e-5, "muon": 1e-4}


# Inductor for one dense and one MoE model, unified on the dense one (every kind of site), baseline
# on the MoE one (its experts' loop): on a fresh machine its code generation (a C++ compile per
# fused kernel, no cache yet) was most of this file's time, about 2 minutes of CPU per case. The
# other two pairs compile with aot_eager: dynamo's graphs and AOT autograd's forward and backward,
# which inductor lowers, trained against eager with the same tolerances. Inductor's C++ here is
# scalar (cpp.vec_isa_ok off): the vectorized kernels' headers were a third of a case's time, and no
# user trains with inductor's CPU code (on a GPU it writes Triton, tests/gpu); the lowering, fusions
# and the fused ops' registrations are the same.
# The dense inductor case compiles its blocks checkpointed selectively (the eager run keeps every
# activation): inductor's code for a partition that recomputes, at no extra compile (the partition
# itself is checked on AOT autograd's graphs above).
CASES = [("dense-tiny", "unified", "inductor", "selective"),
         ("moe-tiny", "baseline", "inductor", "none"),
         ("dense-tiny", "baseline", "aot_eager", "none"),
         ("moe-tiny", "unified", "aot_eager", "none")]


@pytest.mark.parametrize("model,scale,backend,ac", CASES)
def test_compiled_training_matches_eager(model, scale, backend, ac):
    """distributed.compile=true (blocks and loss) with activation checkpointing `ac` against eager
    without checkpointing, fp32 on CPU; each model compiles once and trains with both optimizers (4
    experts instead of moe-tiny's 8: the per-expert loop unrolls into the graph, and compile time
    grows with it). One block: each block is compiled on its own, the same code, and a second one
    cost dynamo, AOT autograd and inductor their work again (the dense inductor case took 47-53
    CPU-s with 2 blocks, 34 with 1, cold caches, 2-core CPU, 2026-11-28); blocks compiled side by
    side are tests/training/test_probes.py's two-rank run."""
    overrides = [f"model={model}", f"scale={scale}", "model.n_layers=1", "model.vocab_size=128",
                 "optim.lr=1e-3"]
    if model == "moe-tiny":
        overrides.append("model.moe.num_experts=4")
    results = {}
    for compiled in (False, True):
        cfg = make_config(*overrides, f"distributed.compile={str(compiled).lower()}",
                          f"distributed.activation_checkpointing={ac if compiled else 'none'}")
        with torch.device("meta"):
            net = Transformer(cfg.model, cfg.scale)
        with compile_backend(None if backend == "inductor" else backend), \
                torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
            net = parallelize(net, cfg.distributed, torch.device("cpu"), seed=0,
                              dtype=cfg.train.dtype)
            results[compiled] = {optim: train(net, [*overrides,
                                                    f"distributed.compile={str(compiled).lower()}"],
                                              optim) for optim in TOLERANCE}
    torch._dynamo.reset()
    for optim, eager in results[False].items():
        assert results[True][optim] == pytest.approx(eager, rel=TOLERANCE[optim]), optim
        assert eager[0] - eager[-1] > 0.4  # the steps moved the model

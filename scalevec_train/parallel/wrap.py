"""Activation checkpointing and torch.compile, applied to each block's forward in place, so that
parameter names (and with them initial values, optimizer groups and checkpoints) are the same under
every setting (eager_blocks undoes it for a while):
  none       keep all activations.
  selective  keep the outputs of matrix multiplies and attention; recompute the cheap element-wise
             work between them (norms, RoPE, SiLU * up) in the backward pass.
  full       keep only each block's input; recompute the whole block in the backward pass.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

# Ops whose outputs selective checkpointing keeps: the matrix multiplies (FP8's too: model.fp8) and
# attention (expensive to recompute). Everything else in a block is element-wise or a reduction and
# is recomputed, FP8's casts included.
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_matmuls)


def wrap_block(block: nn.Module, ac: str, compile_block: bool, fullgraph: bool = True) -> None:
    """Replace `block.forward` by its checkpointed and/or compiled version. Done on the instance,
    not with a wrapper module, so that parameter names stay as they are. `fullgraph` False: the
    graph may break (expert parallelism runs the dispatched experts outside it: moe.py)."""
    if ac == "none" and not compile_block:
        return
    inner = block.forward
    if compile_block and not fullgraph:
        # A graph break inside a checkpointed region makes dynamo run the whole region eagerly: here
        # the checkpoint goes around the compiled forward, and its graphs take the data-dependent
        # shapes (bincount, tolist) that fullgraph traces without asking.
        inner = torch._dynamo.config.patch(capture_scalar_outputs=True,
                                           capture_dynamic_output_shape_ops=True)(
            torch.compile(inner))
    if ac == "full":
        def forward(*args):
            return checkpoint(inner, *args, use_reentrant=False)
    elif ac == "selective":
        # Selective checkpointing matches each op of the recomputation to the forward's by its
        # count. The profiler's annotations are not computation, and FSDP's hooks make others in a
        # recomputation: a module sharded on its own inside a block (the experts under expert
        # parallelism) opens an extra "FSDP::root_pre_forward" there. Ignored as torch ignores
        # detach (pytorch/pytorch#196862 proposes the same); torch's set is process-wide, so it
        # changes only in a process that checkpoints selectively, once per block wrapped, not per
        # step.
        torch.utils.checkpoint.SAC_IGNORED_OPS |= {
            torch.ops.profiler._record_function_enter_new.default,
            torch.ops.profiler._record_function_exit._RecordFunction}

        def forward(*args):
            return checkpoint(inner, *args, use_reentrant=False, context_fn=_selective_contexts)
    else:
        forward = inner
    if compile_block and fullgraph:  # the checkpointed forward compiled as one graph
        # fullgraph: a graph break is an error, not a silent slowdown
        # (tests/parallel/test_compile.py).
        forward = torch.compile(forward, fullgraph=True)
        if ac != "none":
            # The MoE layer's forward records state (token counts, the auxiliary loss): compiled, a
            # checkpointed region records it once and does not replay it in the recomputation. The
            # counts only ever enter as relative loads, so recorded once or twice they act alike.
            forward = torch._dynamo.config.patch(
                skip_fwd_side_effects_in_bwd_under_checkpoint=True)(forward)
    block.forward = forward


@contextmanager
def eager_blocks(model: nn.Module) -> Iterator[None]:
    """Within the context every block runs its own forward, neither checkpointed nor compiled
    (forward hooks on its submodules then see every call); FSDP's hooks, on the block's __call__,
    stay."""
    wrapped = [(block, vars(block)["forward"]) for block in model.layers
               if "forward" in vars(block)]
    for block, _ in wrapped:
        del block.forward  # the class's forward shows through
    try:
        yield
    finally:
        for block, forward in wrapped:
            block.forward = forward

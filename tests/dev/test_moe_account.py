"""What one MoE layer's forward and backward dispatch, counted on the CPU by dev/moe_account.py
(issue 49, item 4): no host read on the grouped path, one on the loop (its split sizes), and at most
the operators counted when the routing was last reworked, so that an added sync, launch or grouped
GEMM shows here. The layer is moe-l1's: moe-2b's options (softmax, renormalized top-k, z-loss, no
shared expert) at width 32, so the counts are moe-2b's (they do not depend on widths or tokens on
the grouped path)."""

import pytest
import torch

from scalevec_train.config import compose_config
from scalevec_train.model.moe import _grouped_mm_supported
from tests.support.helpers import REPO, load_script

# (scale, backend): (forward operators at most, backward at most, host reads, grouped GEMMs),
# counted 2026-11-28 (torch 2.13, CPU, bf16 autocast; unified's expert SwiGLU on the PyTorch
# reference norms, kernels=auto on a CPU). Before the rework the grouped path read the host once
# (bincount). Three grouped GEMMs forward and six backward: gate and up as one GEMM of the stacked
# weights would save three, at a copy of the stacked weights each forward and other rounding (left
# for a GPU to decide).
BOUNDS = {("baseline", "grouped_mm"): (47, 53, [], 9),
          ("unified", "grouped_mm"): (83, 115, [], 9),
          ("baseline", "loop"): (69, 143, ["tolist()"], 0)}


@pytest.fixture(scope="module")
def account():
    return load_script(REPO / "dev" / "moe_account.py")


@pytest.mark.parametrize("scale,backend", list(BOUNDS))
def test_launches_and_host_reads_of_a_layer(account, scale, backend):
    forward, backward, reads, grouped = BOUNDS[scale, backend]
    acc = account.account(account.build_layer("moe-l1", scale, backend), tokens=64)
    counted = (sum(not o.backward for o in acc.ops), sum(o.backward for o in acc.ops))
    assert acc.host_reads() == reads
    assert counted[0] <= forward and counted[1] <= backward, counted
    assert len(acc.grouped_mm) == grouped, acc.grouped_mm
    # every operator is placed in a phase of the layer
    assert {o.phase for o in acc.ops} <= set(account.PHASES) - {"other"}, {o.phase for o in acc.ops}


@pytest.mark.parametrize("preset",
                         sorted(p.stem for p in (REPO / "configs" / "model").glob("moe-*.yaml")))
def test_every_moe_preset_takes_the_grouped_path_in_bf16(preset):
    """backend=auto takes torch._grouped_mm for every MoE preset's routed (and shared) widths in
    bf16: rows aligned to 16 bytes (the CPU answers for the alignment; on a GPU auto also needs
    sm_90)."""
    moe = compose_config([f"model={preset}"], 1).model
    x = torch.empty(0, moe.dim, dtype=torch.bfloat16)
    assert _grouped_mm_supported(x, (moe.dim, moe.moe.expert_dim))

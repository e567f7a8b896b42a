"""The whole model through the Triton kernels (model.kernels=triton, under triton's CPU interpreter,
in fp32) against the same model on the PyTorch path (model.kernels=torch): the same logits and
gradients, and the same losses over a few optimizer steps, for dense and MoE models under baseline
and unified in both placement readings, and under document masking. This covers every fused path the
model takes: the pre-norms with the residual add of the previous sub-layer (and the final norm), the
per-head norms behind q, k, v, and the fused normalization + SwiGLU of the dense FFN, the shared
expert and the routed experts (per-expert scales).

The interpreter runs in a child process (tests/support/kernels.py says why).
"""

import pytest
import torch
import torch.nn.functional as F

from scalevec_kernels.backend import INTERPRETED
from scalevec_train.model.strategies import scale_sites
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from tests.support.helpers import make_config
from tests.support.kernels import run_interpreted

SMALL = ["model.n_layers=1", "model.vocab_size=128"]
MOE = ["model=moe-tiny", "model.moe.num_experts=4"]
REV1 = "scale.targets=[q,k,o,down]"
CASES = {
    "dense-baseline": ["scale=baseline"],
    "dense-unified": ["scale=unified"],
    "dense-unified-rev1": ["scale=unified", REV1],
    "moe-baseline": [*MOE, "scale=baseline"],
    "moe-unified": [*MOE, "scale=unified"],
    "moe-unified-rev1": [*MOE, "scale=unified", REV1],
    "dense-unified-document": ["scale=unified", "model.attention_mask=document",
                               "model.rope_reset=true"],
}
# the document ids of the 16 inputs of each row (the causal models ignore them)
DOC_IDS = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 4 + [2] * 3])
STEPS = 2


def build(case: str, kernels: str):
    cfg = make_config(*CASES[case], *SMALL, f"model.kernels={kernels}", "optim.lr=1e-2")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every site away from 1, so that each one matters
        for _, site in scale_sites(model):
            for p in site.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model, build_optimizer(model, cfg.optim)


def losses_and_first_grads(case: str, kernels: str):
    model, optimizer = build(case, kernels)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    losses, first = [], None
    for _ in range(STEPS):
        logits = model(tokens[:, :-1], doc_ids=DOC_IDS)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        aux = model.auxiliary_loss()
        (loss if aux is None else loss + aux).backward()
        if first is None:
            first = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        model.update_after_step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first


if INTERPRETED:

    @pytest.mark.parametrize("case", sorted(CASES))
    def test_interp_model_on_triton_equals_model_on_torch(case):
        want_losses, (want_logits, want_grads) = losses_and_first_grads(case, "torch")
        got_losses, (got_logits, got_grads) = losses_and_first_grads(case, "triton")
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
        assert got_losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
        assert want_losses[-1] != want_losses[0]  # the steps moved the model

else:

    def test_the_model_through_the_interpreted_kernels():
        run_interpreted(__file__)

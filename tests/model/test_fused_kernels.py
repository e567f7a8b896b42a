"""The whole model through the Triton kernels (model.kernels=triton, under triton's CPU interpreter,
in fp32) against the same model on the PyTorch path (model.kernels=torch): the same logits and
gradients, and the same losses over a few optimizer steps, for dense and MoE models under baseline
and unified in both placement readings, and under document masking. This covers every fused path the
model takes: the pre-norms with the residual add of the previous sub-layer (and the final norm), the
per-head norms behind q, k, v, and the fused normalization + SwiGLU of the dense FFN, the shared
expert and the routed experts (per-expert scales). Then model.kernels=auto as on a GPU, compiled:
the choice between the fused kernels and compile's code traced inside torch.compile.

The interpreter runs in a child process (tests/support/kernels.py says why).
"""

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from dev.kernel_tools import aot
from scalevec_kernels.backend import INTERPRETED
from scalevec_train.model.strategies import scale_sites
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.parallel.wrap import wrap_block
from tests.support.helpers import make_config
from tests.support.launch import compile_backend

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


def perturbed(model: Transformer) -> Transformer:
    """The model initialized, every site moved away from 1 so that each one matters."""
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, site in scale_sites(model):
            for p in site.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def build(case: str, kernels: str):
    cfg = make_config(*CASES[case], *SMALL, f"model.kernels={kernels}", "optim.lr=1e-2")
    model = perturbed(Transformer(cfg.model, cfg.scale))
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

    def unified_logits_and_grads(kernels: str, as_cuda: bool, backend=None):
        """(logits, {name: grad}, model) of a one-block unified model 1024 wide with perturbed
        scales; `as_cuda`: the calls routed as for CUDA tensors (aot.routed_as_cuda), the kernels
        interpreted on CPU tensors;
        `backend`: its block compiled with fullgraph by that torch.compile backend."""
        cfg = make_config("scale=unified", "model.dim=1024", "model.n_heads=8",
                          "model.n_kv_heads=8", "model.ffn_dim=2048", "model.n_layers=1",
                          "model.vocab_size=128", "device=cpu", f"model.kernels={kernels}")
        model = perturbed(Transformer(cfg.model, cfg.scale))
        with aot.routed_as_cuda() if as_cuda else nullcontext(), compile_backend(backend):
            for block in model.layers:
                wrap_block(block, "none", backend is not None)
            logits = model(torch.randint(0, 128, (2, 16),
                                         generator=torch.Generator().manual_seed(2)))
            logits.logsumexp(-1).mean().backward()
        return logits, {n: p.grad for n, p in model.named_parameters()}, model

    def test_interp_auto_compiled_on_the_cuda_path_matches_the_eager_reference():
        """model.kernels=auto as on a GPU, inside torch.compile(fullgraph=True) with AOT autograd's
        forward and backward graphs (no code generation), against the PyTorch path eager: at this
        width the measurements pick the fused kernels for some norms and compile's code for others,
        so both branches of the choice are traced (a graph break is an error; the first GPU run of
        the choice failed to trace its table read). Fp32: the same to rounding, except the
        magnitude of a site whose every map is normalized right after (exact gradient 0, each
        path's own rounding noise; tests/gpu/test_training_gpu.py says more)."""
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        from scalevec_kernels import choice

        ops = set()

        def record(gm, _):
            ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)

        assert {choice.faster("rms_norm", 1024, k) for k in (1, 2, 3)} == {"fused", "compile"}
        want_logits, want, model = unified_logits_and_grads("torch", as_cuda=False)
        got_logits, got, _ = unified_logits_and_grads(
            "auto", as_cuda=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        assert {"scalevec.rms_norm_fwd.default", "scalevec.rms_norm_bwd.default",
                "scalevec.swiglu_norm_fwd.default", "scalevec.swiglu_norm_bwd.default"} <= ops
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-4)
        cancelled = {id(m.site) for m in model.site_maps() if m.cancelled_by}
        noise = {f"{name}.beta" for name, site in scale_sites(model) if id(site) in cancelled}
        assert len(noise) == 5  # q, k, v, gate and up branch sites
        largest = max(g.abs().max() for g in want.values())
        for name, g in want.items():
            bound = 1e-6 * largest if name in noise else 1e-4 * g.abs().max()
            assert (got[name] - g).abs().max() <= bound, name

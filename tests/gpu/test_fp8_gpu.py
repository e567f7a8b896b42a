"""FP8 training (model.fp8) on CUDA's own FP8 matmul (torch._scaled_mm, which the CPU tests
emulate; skipped without compute capability 8.9): each converted map's output and gradients against
bf16's within the CPU tests' SNR floors, and the compiled trainer's loss under tensorwise and
rowwise within the CPU tests' bound of bf16's over 30 steps, under baseline and unified."""

from statistics import mean

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.model.layers import Linear
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.train import run
from tests.gpu.test_training_gpu import FAST
from tests.parallel.test_fp8 import SNR_FLOOR, snr_db
from tests.parallel.test_fp8_training import LOSS_BOUND, MEAN_BOUND
from tests.support.helpers import make_config
from tests.support.launch import curve

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device with FP8 matmuls (compute capability 8.9 or newer)")

CUDA = torch.device("cuda")
STEPS = 30


@pytest.mark.parametrize("recipe", sorted(SNR_FLOOR))
def test_every_converted_map_on_cuda_is_within_its_snr_floor_of_bf16(recipe):
    """Each of the 14 maps of a two-block unified model (every dim divides by 16), on the inputs a
    bf16 forward gives it: its FP8 matmul against F.linear under the same autocast."""
    cfg = make_config(*FAST, "scale=unified", f"model.fp8={recipe}", "model.fp8_filter=all")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    model = parallelize(model, cfg.distributed, CUDA, seed=0, dtype="bf16")
    inputs, matmuls = {}, {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.matmul is not F.linear
            matmuls[name] = m.matmul

            def recorded(x, w, name=name):
                inputs[name] = x.detach()
                return matmuls[name](x, w)
            m.matmul = recorded
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (8, 128), generator=gen, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(tokens)
    assert len(inputs) == 14
    for name, x in inputs.items():
        weight = model.get_submodule(name).weight
        grad = torch.randn(*x.shape[:-1], weight.shape[0], generator=gen, device="cuda")
        results = []
        for matmul in (matmuls[name], F.linear):
            x_, w = x.clone().requires_grad_(), weight.detach().clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = matmul(x_, w)
            y.backward(grad.bfloat16())
            results.append((y, x_.grad, w.grad))
        for what, got, want, floor in zip(("output", "input grad", "weight grad"), *results,
                                          SNR_FLOOR[recipe], strict=True):
            assert snr_db(got, want) >= floor, (name, what, snr_db(got, want))


@pytest.mark.parametrize("scale", ["baseline", "unified"])
def test_compiled_training_under_fp8_on_cuda_stays_within_its_bound_of_bf16(data_overrides,
                                                                            tmp_path, scale):
    common = [*data_overrides, *FAST, f"scale={scale}", f"train.steps={STEPS}", "train.log_every=1",
              "model.fp8_filter=all", "distributed.compile=true"]
    curves = {recipe: curve(run(make_config(*common, f"model.fp8={recipe}",
                                            f"run_dir={tmp_path / recipe}")))
              for recipe in ("none", "tensorwise", "rowwise")}
    bf16 = curves["none"]
    assert len(bf16) == STEPS and bf16[STEPS] < bf16[1] - 0.5  # it learns
    last = [s for s in bf16 if s > STEPS - 10]
    for recipe in ("tensorwise", "rowwise"):
        gaps = [abs(curves[recipe][s] - bf16[s]) for s in bf16]
        assert 0 < max(gaps) <= LOSS_BOUND, (recipe, max(gaps))
        gap = abs(mean(curves[recipe][s] for s in last) - mean(bf16[s] for s in last))
        assert gap <= MEAN_BOUND, (recipe, gap)

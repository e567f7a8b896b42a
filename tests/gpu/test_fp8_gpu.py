"""FP8 training (model.fp8) on CUDA's own FP8 matmul (torch._scaled_mm, which the CPU tests
emulate; skipped without compute capability 8.9): each converted map's output and gradients against
bf16's within the CPU tests' SNR floors, and the compiled trainer's loss under tensorwise and
rowwise within the CPU tests' bound of bf16's over 30 steps, under baseline and unified."""

from statistics import mean

import pytest
import torch

from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.train import run
from tests.gpu.test_training_gpu import FAST
from tests.parallel.test_fp8 import SNR_FLOOR, assert_maps_within_snr_floors
from tests.parallel.test_fp8_training import LOSS_BOUND, MEAN_BOUND, RECIPES, RUN, STEPS
from tests.support.helpers import make_config
from tests.support.launch import curve

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device with FP8 matmuls (compute capability 8.9 or newer)")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("recipe", sorted(SNR_FLOOR))
def test_every_converted_map_on_cuda_is_within_its_snr_floor_of_bf16(recipe):
    """The 14 maps of a two-block unified model (every dim divides by 16)."""
    cfg = make_config(*FAST, "scale=unified", f"model.fp8={recipe}", "model.fp8_filter=all")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    model = parallelize(model, cfg.distributed, CUDA, seed=0, dtype="bf16")
    tokens = torch.randint(0, cfg.model.vocab_size, (8, 128), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    assert_maps_within_snr_floors(model, tokens, recipe)


@pytest.mark.parametrize("scale", ["baseline", "unified"])
def test_compiled_training_under_fp8_on_cuda_stays_within_its_bound_of_bf16(data_overrides,
                                                                            tmp_path, scale):
    """The CPU test's runs (tests/parallel/test_fp8_training.py, whose bounds were measured on
    them), on CUDA and compiled."""
    common = [*data_overrides, *RUN, f"scale={scale}", "device=cuda", "distributed.compile=true"]
    curves = {recipe: curve(run(make_config(*common, f"model.fp8={recipe}",
                                            f"run_dir={tmp_path / recipe}")))
              for recipe in RECIPES}
    bf16 = curves["none"]
    assert len(bf16) == STEPS and bf16[STEPS] < bf16[1] - 1  # it learns
    last = [s for s in bf16 if s > STEPS - 10]
    for recipe in ("tensorwise", "rowwise"):
        gaps = [abs(curves[recipe][s] - bf16[s]) for s in bf16]
        assert 0 < max(gaps) <= LOSS_BOUND, (recipe, max(gaps))
        gap = abs(mean(curves[recipe][s] for s in last) - mean(bf16[s] for s in last))
        assert gap <= MEAN_BOUND, (recipe, gap)

"""dev/kernel_table.py's capture of the presets' launches: its shortcut (the maps' weights take no
gradient) launches what training launches."""

import pytest

from scalevec_kernels import backend
from scalevec_train.config import compose_config
from tests.support.helpers import REPO, load_script

pytest.importorskip("triton")
if backend.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: the capture records the compiled kernels' launches",
                allow_module_level=True)
kernel_table = load_script(REPO / "dev" / "kernel_table.py")


@pytest.mark.parametrize("preset,strategy",
                         [("dense-tiny-gemma", "baseline"), ("dense-tiny", "unified-full-heads"),
                          ("moe-tiny", "unified-per-expert"), ("moe-tiny", "none")])
def test_the_capture_without_weight_gradients_launches_what_training_launches(preset, strategy):
    """The capture leaves the maps' weights without gradients (kernel_table._capture_model): with
    them, as training has them, the same variants launch, in the same order."""
    model = compose_config([f"model={preset}", *kernel_table.CHEAP], 1).model
    scale = compose_config(["model=moe-tiny", *kernel_table.STRATEGIES[strategy],
                            *kernel_table.CHEAP], 1).scale
    frozen = kernel_table._capture_model(model, scale)
    trained = kernel_table._capture_model(model, scale, weight_grads=True)
    assert (frozen.variants and frozen.variants == trained.variants
            and frozen.widths == trained.widths)

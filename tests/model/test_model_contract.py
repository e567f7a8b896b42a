"""Dense and MoE models offer what the training, parallel and checkpoint code call on a model (the
trainer, FSDP wrapping, the optimizer's groups and the checkpoint manager type it as Transformer):
each method below with these parameters, the blocks as a ModuleList, the plan and
the parameterization."""

import inspect

import pytest
import torch

from scalevec_train.model import Transformer
from scalevec_train.model.parameterization import Parameterization
from scalevec_train.model.plan import ScalePlan
from tests.support.helpers import make_config

# what the code outside the model calls, written out here: {method: its parameters}
CALLED = {"auxiliary_loss": [], "discard_step_state": [], "update_after_step": ["taken"],
          "compute_metrics": [], "site_maps": [], "initial_value": ["name", "shape", "seed"],
          "init_weights": ["seed"], "init_buffers": [], "forward": ["tokens", "doc_ids"]}


@pytest.mark.parametrize("preset", ["dense-tiny", "moe-tiny"])
def test_models_offer_what_the_training_code_calls(preset):
    cfg = make_config(f"model={preset}")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == cfg.model.n_layers
    assert (isinstance(model.plan, ScalePlan)
            and isinstance(model.parameterization, Parameterization))
    for name, params in CALLED.items():
        assert list(inspect.signature(getattr(model, name)).parameters) == params, name
    # each is documented where it is defined: what the caller may rely on
    assert all(inspect.getdoc(getattr(model, name)) for name in CALLED if name != "forward"), CALLED


def test_a_module_without_the_methods_lacks_them():
    assert not any(hasattr(torch.nn.Linear(2, 2), name) for name in CALLED if name != "forward")

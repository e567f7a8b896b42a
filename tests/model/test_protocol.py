"""Dense and MoE models satisfy the model contract (model/protocol.py): every method the training,
parallel and checkpoint code call, with the protocol's parameters."""

import inspect

import pytest
import torch

from scalevec_train.model import Transformer
from scalevec_train.model.protocol import TrainableModel
from tests.helpers import make_config

METHODS = [name for name, value in vars(TrainableModel).items()
           if inspect.isfunction(value) and not name.startswith("_")]


@pytest.mark.parametrize("preset", ["dense-tiny", "moe-tiny"])
def test_models_satisfy_the_model_protocol(preset):
    cfg = make_config(f"model={preset}")
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    assert isinstance(model, TrainableModel)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == cfg.model.n_layers
    assert {"auxiliary_loss", "discard_step_state", "update_after_step", "compute_metrics",
            "initial_value", "init_weights", "init_buffers"} <= set(METHODS)
    for name in METHODS:
        expected = list(inspect.signature(getattr(TrainableModel, name)).parameters)[1:]
        assert list(inspect.signature(getattr(model, name)).parameters) == expected, name


def test_a_module_without_the_methods_does_not_satisfy_it():
    assert not isinstance(torch.nn.Linear(2, 2), TrainableModel)

"""training/skip.py: an optimizer step applied where a device flag says. A taken step equals the
optimizer's own step followed by the model's update after it, bit for bit; a skipped one leaves
parameters, optimizer state and the model's buffers (the MoE expert biases, which
model.update_after_step moves) exactly as they were, so that the next step equals that of a run that
never had it. For torch's for-loop AdamW (copies kept), the fused AdamW (on CPU here, on CUDA in
real runs) and Muon with its AdamW groups, which take the flag themselves (StepsWhere), with the
`er` sites' log decay and the MoE bias update taking it too: nothing copied."""

import pytest
import torch
import torch.nn.functional as F

from scalevec_train.model import Transformer
from scalevec_train.optim.adamw import FusedAdamW, StepsWhere
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.training.skip import ConditionalStep
from tests.support.helpers import make_config
from tests.support.presets import TINY_MOE

SHAPE = [*TINY_MOE, "model.vocab_size=64", "scale=er", "scale.weight_decay=all"]


def setup(optim: str):
    cfg = make_config(*SHAPE, f"optim={'muon' if optim == 'muon' else 'adamw'}")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(0)
    optimizer = build_optimizer(model, cfg.optim)
    if optim == "fused":
        keys = ("params", "lr", "weight_decay", "betas", "eps", "log_weight_decay")
        groups = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
        optimizer = FusedAdamW(groups)
    return model, optimizer, ConditionalStep(optimizer, model)


def backward(model, seed: int, poison: bool = False) -> None:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = (F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            + model.auxiliary_loss())
    (loss * float("nan") if poison else loss).backward()


def snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    out.update({f"buffer/{k}": v.clone() for k, v in model.named_buffers()})
    for i, state in enumerate(optimizer.state.values()):
        out.update({f"optim/{i}/{k}": v.clone() for k, v in state.items()
                    if isinstance(v, torch.Tensor)})
    return out


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("optim", ["adamw", "fused", "muon"])
def test_taken_steps_are_the_optimizers_own_and_skipped_ones_change_nothing(optim):
    model, optimizer, step_where = setup(optim)
    ref_model, ref_optimizer, _ = setup(optim)
    # what the flag must reach besides the optimizer's update: the er magnitudes' log decay, the MoE
    # biases
    assert (any(g.get("log_weight_decay") for g in optimizer.param_groups)
            and model.compute_metrics())
    for seed in (1, 2):  # taken: the same as optimizer.step()
        backward(model, seed)
        step_where(torch.tensor(True))
        model.discard_step_state()
        optimizer.zero_grad()
        backward(ref_model, seed)
        ref_optimizer.step()
        ref_model.update_after_step()
        ref_model.discard_step_state()
        ref_optimizer.zero_grad()
        assert_identical(snapshot(model, optimizer), snapshot(ref_model, ref_optimizer))
    before = snapshot(model, optimizer)
    backward(model, 3, poison=True)  # skipped: nothing changes
    step_where(torch.tensor(False))
    model.discard_step_state()
    optimizer.zero_grad()
    assert_identical(snapshot(model, optimizer), before)
    backward(model, 4)  # and the next step is that of a run without the skipped one
    step_where(torch.tensor(True))
    backward(ref_model, 4)
    ref_optimizer.step()
    ref_model.update_after_step()
    assert_identical(snapshot(model, optimizer), snapshot(ref_model, ref_optimizer))
    assert isinstance(optimizer, StepsWhere) == (optim != "adamw")
    # copies kept only where the flag is not taken
    assert bool(step_where.copies) == (optim == "adamw")


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_a_skipped_first_step_leaves_the_state_as_new(optim):
    model, optimizer, step_where = setup(optim)
    ref_model, ref_optimizer, _ = setup(optim)
    backward(model, 1, poison=True)
    step_where(torch.tensor(False))
    model.discard_step_state()
    optimizer.zero_grad()
    backward(model, 2)
    step_where(torch.tensor(True))
    backward(ref_model, 2)
    ref_optimizer.step()
    ref_model.update_after_step()
    assert_identical(snapshot(model, optimizer), snapshot(ref_model, ref_optimizer))

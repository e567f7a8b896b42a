"""Single-process Muon against torch.optim.Muon / torch.optim.AdamW and against closed forms."""

import io

import pytest
import torch

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.optim.muon import Muon, newton_schulz
from scalevec_train.optim.muon_dist import assign_owners, local_row_range

SHAPES = [(48, 16), (16, 40), (32, 32)]  # tall, wide, square


def _run(params, opt, steps, seed=1):
    """`steps` optimizer steps on fixed random gradients (the same for any optimizer given the
    seed)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _leaves(tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("lr_adjust,nesterov", [("original", True), ("match_rms_adamw", True),
                                                ("match_rms_adamw", False)])
def test_matches_torch_muon(lr_adjust, nesterov):
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    theirs = _leaves(init)
    _run(theirs, torch.optim.Muon(theirs, lr=0.02, nesterov=nesterov, adjust_lr_fn=lr_adjust), 5)
    for ns_dtype in (torch.bfloat16, torch.float32):
        ours = _leaves(init)
        _run(ours, Muon(ours, lr=0.02, nesterov=nesterov, lr_adjust=lr_adjust, ns_dtype=ns_dtype),
             5)
        for p0, a, b in zip(init, ours, theirs, strict=True):
            ours_update, their_update = a.detach() - p0, b.detach() - p0
            rel = ((ours_update - their_update).norm() / their_update.norm()).item()
            if ns_dtype == torch.bfloat16:  # torch's own dtype and operation order: bit for bit
                assert torch.equal(a, b), (p0.shape, rel)
            else:  # fp32 orthogonalization differs from torch's bf16 by rounding only
                assert 0 < rel <= 0.05, (p0.shape, rel)


def test_polar_express_reaches_the_polar_factor():
    torch.manual_seed(0)
    g = torch.randn(64, 16)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    for x, ref in ((g, polar), (g.T, polar.T)):
        err = (newton_schulz(x, 8, "polar_express", torch.float32) - ref).abs().max().item()
        assert err < 1e-4, err
    # the quintic's fixed point is not 1: its singular values only land in roughly [0.7, 1.2]
    sv = torch.linalg.svdvals(newton_schulz(g, 5, "quintic", torch.float32))
    assert sv.min() > 0.5 and sv.max() < 1.3 and (newton_schulz(g, 5, "quintic", torch.float32)
                                                   - polar).abs().max() > 1e-2


def test_expert_stack_equals_per_matrix():
    torch.manual_seed(0)
    stack = torch.randn(3, 12, 20)
    batched = _leaves([stack])
    separate = _leaves(list(stack))
    opt = Muon(batched, lr=0.02, ns_dtype=torch.float32)
    ref = Muon(separate, lr=0.02, ns_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        g = torch.randn(3, 12, 20, generator=gen)
        batched[0].grad = g
        for p, part in zip(separate, g, strict=True):
            p.grad = part.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(batched[0].detach(), torch.stack([p.detach() for p in separate]),
                               rtol=1e-5, atol=1e-6)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    init = [torch.randn(32, 16), torch.randn(16), torch.randn(11, 16), torch.randn(7)]
    ours = _leaves(init)
    opt = Muon([{"params": ours[:1]},
                {"params": ours[1:3], "use_muon": False, "lr": 3e-3},
                {"params": ours[3:], "use_muon": False, "lr": 3e-3, "weight_decay": 0.0}],
               lr=0.02, weight_decay=0.1)
    theirs = _leaves(init)
    muon_ref = torch.optim.Muon(theirs[:1], lr=0.02, weight_decay=0.1,
                                adjust_lr_fn="match_rms_adamw")
    adamw_ref = torch.optim.AdamW([{"params": theirs[1:3]},
                                   {"params": theirs[3:], "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    # 70 steps: at step 69 Python's (1 - 0.95**69) ** 0.5, which torch's update uses, and sqrt()
    # differ
    for _ in range(70):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        muon_ref.step()
        adamw_ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), a.shape


def _mixed(params):
    return Muon([{"params": params[:1]}, {"params": params[1:2]},
                 {"params": params[2:], "use_muon": False, "lr": 3e-3}],
                lr=0.02, ns_coefficients="polar_express", ns_dtype=torch.float32)


# how a state saved before the AdamW step counters moved to the device may hold them
SAVED_STEPS = {"as_saved": lambda t: t, "number": lambda t: t.item(),
               "float64": lambda t: t.double()}


@pytest.mark.parametrize("saved_step", SAVED_STEPS)
def test_state_dict_round_trip(saved_step):
    torch.manual_seed(0)
    init = [torch.randn(32, 24), torch.randn(2, 12, 20), torch.randn(24), torch.randn(9, 24)]
    straight = _leaves(init)
    _run(straight, _mixed(straight), 5)

    first = _leaves(init)
    opt = _mixed(first)
    _run(first, opt, 2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed = [p.detach().clone().requires_grad_() for p in first]
    opt2 = Muon([{"params": resumed[:1]}, {"params": resumed[1:2]},
                 {"params": resumed[2:], "use_muon": False}])  # hyperparameters come from the state
    saved = torch.load(buffer)
    for state in saved["state"].values():
        if "step" in state:
            state["step"] = SAVED_STEPS[saved_step](state["step"])
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["ns_dtype"] == "float32" and opt2.param_groups[2]["lr"] == 3e-3
    steps = [s["step"] for s in opt2.state.values() if "step" in s]
    assert len(steps) == 2 and all(isinstance(s, torch.Tensor) and s.dtype == torch.float32
                                   and s.ndim == 0 and s.device == resumed[2].device
                                   and s.item() == 2 for s in steps)
    # the remaining 3 steps see the gradients that steps 3..5 of the uninterrupted run saw
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in resumed]
        if step >= 2:
            for p, g in zip(resumed, grads, strict=True):
                p.grad = g
            opt2.step()
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b), a.shape


def test_checkpoints_keep_the_group_key_names_they_were_written_with():
    """In memory a group has OptimConfig's names; its state stores them as checkpoints always did
    (adamw_betas, adamw_eps, and eps for Newton-Schulz; the `split` older ones hold is dropped)."""
    params = _leaves([torch.randn(32, 24), torch.randn(2, 12, 20), torch.randn(24),
                      torch.randn(9, 24)])
    opt = _mixed(params)
    _run(params, opt, 1)
    assert ({"betas", "eps", "ns_eps"} <= set(opt.param_groups[0])
            and "adamw_eps" not in opt.param_groups[0])
    state = opt.state_dict()
    for group in state["param_groups"]:
        assert (group["adamw_betas"], group["adamw_eps"], group["eps"]) == ((0.9, 0.95), 1e-8, 1e-7)
        assert "ns_eps" not in group and "betas" not in group
        group["split"] = None
    fresh = _mixed([p.detach().clone().requires_grad_() for p in params])
    fresh.load_state_dict(state)
    for group in fresh.param_groups:
        assert (group["betas"], group["eps"], group["ns_eps"]) == ((0.9, 0.95), 1e-8, 1e-7)
        assert "split" not in group and "adamw_eps" not in group


def test_bad_groups_raise():
    with pytest.raises(ScalevecError, match="AdamW group"):
        Muon([torch.zeros(4, requires_grad=True)])
    with pytest.raises(ScalevecError, match="ns_eps"):
        Muon([torch.zeros(10, 4, requires_grad=True)], ns_eps=0.0)
    with pytest.raises(ScalevecError, match="group 1: eps"):
        Muon([{"params": [torch.zeros(10, 4, requires_grad=True)]},
              {"params": [torch.zeros(3, requires_grad=True)], "use_muon": False, "eps": -1.0}])
    with pytest.raises(ScalevecError, match="ns_coefficients"):
        Muon([torch.zeros(10, 4, requires_grad=True)], ns_coefficients="cubic")
    with pytest.raises(ScalevecError, match="ns_dtype"):
        Muon([torch.zeros(10, 4, requires_grad=True)], ns_dtype=torch.int8)


def test_row_ranges_follow_torch_chunk():
    for rows in (1, 5, 13, 16):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(rows).chunk(world)
            for rank in range(world):
                start, stop = local_row_range(rows, world, rank)
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(start, stop)) == want, (rows, world, rank)


def test_owners_balance_cost():
    costs = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    owners = assign_owners(costs, 3)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(3)]
    assert sorted(loads) == [11.0, 12.0, 13.0]  # largest-first greedy; the optimum is 12 each
    assert assign_owners([5.0, 5.0], 2) == [0, 1]

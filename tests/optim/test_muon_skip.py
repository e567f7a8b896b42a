"""Muon's device-side skip (step_where), on 1 process and on 2 gloo ranks under FSDP2 (row-sharded
matrices orthogonalized on owner ranks, expert stacks, AdamW groups): a taken step equals
Muon's plain step bit for bit, a skipped one (NaN gradients) leaves every parameter and state tensor
bit-identical, and the step after it equals that of a run that never had it. The host never reads
the flag (tests/training/test_host_reads.py counts reads in whole runs)."""

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scalevec_train.parallel.process_group import local
from tests.support.launch import spawn
from tests.support.muon_net import BATCH, VOCAB, build


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter and optimizer-state tensor."""
    out = {f"param/{n}": local(p).detach().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        out.update({f"state/{names[p]}/{k}": local(v).clone() for k, v in state.items()})
    return out


def backward(model, step: int, rank: int, world: int, poison: bool = False) -> None:
    tokens = torch.randint(0, VOCAB, (BATCH, 7),
                           generator=torch.Generator().manual_seed(100 + step)).chunk(world)[rank]
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    (loss * float("nan") if poison else loss).backward()


def flagged_step(opt, taken: bool) -> None:
    opt.step_where(torch.tensor(taken))
    opt.zero_grad()


def mismatches(mesh, rank: int = 0, world: int = 1) -> list[str]:
    """The names of the tensors where the flagged run differs from the plain one (or, on the skipped
    step, from its own state before it); empty when all agree bit for bit."""
    model, opt = build(mesh)
    ref_model, ref_opt = build(mesh)
    bad = []

    def compare(a, b, when):
        assert a.keys() == b.keys(), when
        bad.extend(f"{when}: {k}" for k in a if not torch.equal(a[k], b[k]))

    for step in (0, 1):  # taken: the same as a plain step (the first one creates the state)
        backward(model, step, rank, world)
        flagged_step(opt, taken=True)
        backward(ref_model, step, rank, world)
        ref_opt.step()
        ref_opt.zero_grad()
        compare(snapshot(model, opt), snapshot(ref_model, ref_opt), f"taken step {step}")
    before = snapshot(model, opt)
    backward(model, 2, rank, world, poison=True)  # skipped: nothing changes
    flagged_step(opt, taken=False)
    compare(snapshot(model, opt), before, "skipped step")
    backward(model, 3, rank, world)  # and the next step is that of a run without the skipped one
    flagged_step(opt, taken=True)
    backward(ref_model, 3, rank, world)
    ref_opt.step()
    compare(snapshot(model, opt), snapshot(ref_model, ref_opt), "step after the skipped one")
    assert any(k.endswith("/step") for k in before) and all(
        v.device.type == "cpu" and v.dtype == torch.float32 for k, v in before.items()
        if k.endswith("/step"))
    return bad


def test_skip_on_one_process():
    torch.manual_seed(0)
    assert mismatches(None) == []


def test_skip_on_two_ranks(tmp_path):
    spawn(_worker, (str(tmp_path),))
    assert torch.load(tmp_path / "skip.pt") == {0: [], 1: []}


def _worker(rank, workdir):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        bad = mismatches(init_device_mesh("cpu", (2,)), rank, 2)
        gathered = [None, None]
        dist.all_gather_object(gathered, bad)
        if rank == 0:
            torch.save(dict(enumerate(gathered)), Path(workdir) / "skip.tmp")
            os.replace(Path(workdir) / "skip.tmp", Path(workdir) / "skip.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


"""Muon under FSDP2 on 2 gloo processes against one plain process, and DCP resume across world
sizes.

One spawned group of 2 ranks does all distributed work: FSDP, HSDP with the shard dimension live,
HSDP with only the replica dimension live, a DCP save, and a resume of the one-process checkpoint.
The one-process reference, its checkpoint and the resume of the 2-rank checkpoint run in the pytest
process.
"""

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from tests.support.launch import spawn
from tests.support.muon_net import BATCH, VOCAB, build

STEPS, SAVE_AT = 5, 3
MESHES = {"fsdp": (2,), "hsdp_shard": (1, 2), "hsdp_replicate": (2, 1)}


def train(model, opt, steps, rank=0, world=1):
    """Global-batch losses of `steps`; each rank takes its share of the batch."""
    losses = []
    for step in steps:
        tokens = torch.randint(0, VOCAB, (BATCH, 7),
                               generator=torch.Generator().manual_seed(100 + step))
        tokens = tokens.chunk(world)[rank]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss = loss / world
        losses.append(loss.item())
    return losses


def full_params(model):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def save(model, opt, path):
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load(model, opt, path):
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _worker(rank, workdir):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        out = {}
        for name, shape in MESHES.items():
            names = ("replicate", "shard") if len(shape) == 2 else None
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            model, opt = build(mesh)
            losses = train(model, opt, range(SAVE_AT), rank, 2)
            if name == "fsdp":
                save(model, opt, Path(workdir) / "ckpt_2ranks")
            losses += train(model, opt, range(SAVE_AT, STEPS), rank, 2)
            out[name] = (losses, full_params(model))
        model, opt = build(init_device_mesh("cpu", (2,)), seed=1)
        load(model, opt, Path(workdir) / "ckpt_1process")
        out["resumed_on_2"] = (train(model, opt, range(SAVE_AT, STEPS), rank, 2),
                               full_params(model))
        if rank == 0:  # written whole or not at all; every result needed both ranks' collectives
            torch.save(out, Path(workdir) / "dist.tmp")
            os.replace(Path(workdir) / "dist.tmp", Path(workdir) / "dist.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _assert_params_close(got, want):
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_fsdp_matches_one_process_and_resumes_across_world_sizes(tmp_path):
    model, opt = build(None)
    ref_losses = train(model, opt, range(SAVE_AT))
    save(model, opt, tmp_path / "ckpt_1process")
    ref_losses += train(model, opt, range(SAVE_AT, STEPS))
    ref_params = full_params(model)

    spawn(_worker, (str(tmp_path),))
    out = torch.load(tmp_path / "dist.pt")

    for name in MESHES:
        losses, params = out[name]
        assert losses == pytest.approx(ref_losses, abs=1e-5), name
        _assert_params_close(params, ref_params)
    resumed_losses, resumed_params = out["resumed_on_2"]
    assert resumed_losses == pytest.approx(ref_losses[SAVE_AT:], abs=1e-5)
    _assert_params_close(resumed_params, ref_params)

    model, opt = build(None, seed=1)
    load(model, opt, tmp_path / "ckpt_2ranks")
    assert train(model, opt, range(SAVE_AT, STEPS)) == pytest.approx(ref_losses[SAVE_AT:], abs=1e-5)
    _assert_params_close(full_params(model), ref_params)


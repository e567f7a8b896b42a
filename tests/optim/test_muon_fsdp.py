"""Muon under FSDP2 on 2 gloo processes against one plain process, and DCP resume across world sizes.

One launch of 2 ranks (this file run as a script) does all distributed work: FSDP, HSDP with the
shard dimension live, HSDP with only the replica dimension live, a DCP save, and a resume of the
one-process checkpoint. The one-process reference, its checkpoint and the resume of the 2-rank
checkpoint run in the pytest process.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from scalevec_train.optim.muon import Muon
from tests.launch import child_env

VOCAB, DIM, STEPS, SAVE_AT, BATCH = 11, 16, 5, 3, 8
QKV_SPLIT = [6, 4, 4]
MESHES = {"fsdp": (2,), "hsdp_shard": (1, 2), "hsdp_replicate": (2, 1)}


class Net(nn.Module):
    """Every matrix has its own shape; qkv (14 rows, read as 6/4/4) is sharded 7 + 7, up
    has 13 rows (7 + 6), the 3 experts shard 2 + 1 on the expert dimension."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.ones(DIM))
        self.qkv = nn.Linear(DIM, sum(QKV_SPLIT), bias=False)
        self.o = nn.Linear(sum(QKV_SPLIT), DIM, bias=False)
        self.up = nn.Linear(DIM, 13)
        self.experts = nn.Parameter(torch.randn(3, 12, 13) / 13**0.5)
        self.down = nn.Linear(12, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        q, k, v = self.qkv(x * self.scale).split(QKV_SPLIT, dim=-1)
        x = x + self.o(torch.cat([q, k * v, v], dim=-1).tanh())
        h = F.gelu(self.up(x))
        x = x + self.down(torch.einsum("btij,btj->bti", self.experts[tokens % 3], h))
        return self.head(x)


def build(mesh, seed=0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    if mesh is not None:
        for layer in (model.qkv, model.o, model.up, model.down, model.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    named = dict(model.named_parameters())
    hidden = ["o.weight", "up.weight", "experts", "down.weight"]
    rest = [p for n, p in named.items() if n not in hidden + ["qkv.weight"]]
    opt = Muon([{"params": [named["qkv.weight"]]},
                {"params": [named[n] for n in hidden]},
                {"params": rest, "use_muon": False, "lr": 0.01}],
               lr=0.02, ns_dtype=torch.float32)
    return model, opt


def train(model, opt, steps, rank=0, world=1):
    """Global-batch losses of `steps`; each rank takes its share of the batch."""
    losses = []
    for step in steps:
        tokens = torch.randint(0, VOCAB, (BATCH, 7), generator=torch.Generator().manual_seed(100 + step))
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
        out["resumed_on_2"] = (train(model, opt, range(SAVE_AT, STEPS), rank, 2), full_params(model))
        if rank == 0:  # written whole or not at all; every result needed both ranks' collectives
            torch.save(out, Path(workdir) / "dist.tmp")
            os.replace(Path(workdir) / "dist.tmp", Path(workdir) / "dist.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _assert_params_close(got, want):
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_fsdp_matches_one_process_and_resumes_across_world_sizes(tmp_path, processes):
    model, opt = build(None)
    ref_losses = train(model, opt, range(SAVE_AT))
    save(model, opt, tmp_path / "ckpt_1process")
    ref_losses += train(model, opt, range(SAVE_AT, STEPS))
    ref_params = full_params(model)

    processes.run([sys.executable, __file__, str(tmp_path)], tmp_path, child_env())
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


if __name__ == "__main__":
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(sys.argv[1],), nprocs=2, join=True)

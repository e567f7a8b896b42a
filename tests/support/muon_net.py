"""The small network the Muon tests under FSDP2 train (test_muon_fsdp.py, test_muon_skip.py): a
matrix of every kind Muon meets, each of its own shape, so that shards split unevenly."""

import torch
import torch.nn.functional as F
from torch import nn

from scalevec_train.optim.muon import Muon

VOCAB, DIM, BATCH = 11, 16, 8
QKV_SPLIT = [6, 4, 4]


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

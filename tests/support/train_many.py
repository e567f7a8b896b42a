"""Several training runs in one torchrun launch, so that a test pays once for starting torchrun and
its workers: `torchrun ... tests/support/train_many.py runs.json`, runs.json a list of override
lists.

Each run is what `python -m scalevec_train.train <overrides>` does (compose and validate the config,
then scalevec_train.train.run), in the one process group. After a run every rank also writes what it
holds to <run_dir>/rank<r>.pt: the parameters it holds whole (the scale sites), its shards of the
others, and the MoE expert biases, so that a test can check how the ranks divide the model and that
they agree.
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from scalevec_train import train
from scalevec_train.config import compose_config
from scalevec_train.parallel import process_group


def save_holdings(model: torch.nn.Module, path: Path) -> None:
    params = dict(model.named_parameters())
    whole = {n: p.detach().clone() for n, p in params.items() if not isinstance(p, DTensor)}
    shards = {n: p.to_local().detach().clone() for n, p in params.items() if isinstance(p, DTensor)}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    torch.save({"params": whole, "shards": shards, "expert_bias": biases}, path)


def main(spec: Path) -> None:
    built = []
    build = train.build

    def keep(cfg):  # the real build; the run's model is kept for the per-rank files
        built.append(build(cfg))
        return built[-1]

    train.build = keep
    process_group.init()
    finished = False
    try:
        for overrides in json.loads(spec.read_text()):
            run_dir = train.run(compose_config(overrides, process_group.world_size()))
            # no name here keeps the model: shutdown must free the group it holds
            # (process_group.shutdown)
            save_holdings(built.pop().trainer.model, run_dir / f"rank{process_group.rank()}.pt")
        finished = True
    finally:
        process_group.shutdown(finished)  # together, as the trainer leaves after a run


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""A training step that does not log reads nothing back from the device (issue 28): counted with a
TorchDispatchMode (tests/host_reads.py) over the steps between logs, for dense and MoE, AdamW and Muon,
on 1 process and on 2 gloo ranks. Reads of the optimizer's host-side step counters (torch's for-loop
AdamW on CPU, Muon's AdamW groups) are counted apart and not held against the framework."""

import json
import sys
from pathlib import Path

import pytest
import torch

from scalevec_train.data import prepare_data
from tests.helpers import REPO, make_config
from tests.host_reads import ReadCounter, count_reads

SHAPE = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.ffn_dim=64",
         "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.eval_batches=1",
         "train.eval_every=0", "train.steps=6", "train.log_every=3", "schedule.warmup_steps=2"]
MODELS = {"dense": ["model=dense-tiny"], "moe": ["model=moe-tiny", "model.moe.expert_dim=32"]}
CASES = [(model, optim) for model in MODELS for optim in ("adamw", "muon")]


def overrides(data_overrides, model: str, optim: str, run_dir) -> list[str]:
    return [*data_overrides, *MODELS[model], *SHAPE, f"optim={optim}", "scale=unified", f"run_dir={run_dir}"]


def test_the_counter_sees_item_and_tolist():
    counter = ReadCounter(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    counter.start()
    try:
        torch.ones(()).item()
        bool(torch.ones(()) > 0)
    finally:
        counter.stop()
    assert counter.reads == 2


@pytest.mark.parametrize("model,optim", CASES)
def test_no_reads_between_logs_on_one_process(data_overrides, tmp_path, model, optim):
    out = tmp_path / "reads.json"
    count_reads(overrides(data_overrides, model, optim, tmp_path / "run"), out)
    counts = json.loads(out.read_text())
    assert counts["steps"] == 4 and counts["reads"] == 0, counts


def test_no_reads_between_logs_on_two_ranks(data_overrides, processes, tmp_path):
    prepare_data(make_config(*data_overrides).data)  # once, not by 2 ranks at a time
    for model, optim in CASES:
        out = tmp_path / f"{model}-{optim}-{{rank}}.json"
        processes.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       str(REPO / "tests" / "host_reads.py"), str(out),
                       *overrides(data_overrides, model, optim, tmp_path / f"{model}-{optim}")], tmp_path)
        for rank in (0, 1):
            counts = json.loads(Path(str(out).format(rank=rank)).read_text())
            assert counts["steps"] == 4 and counts["reads"] == 0, (model, optim, rank, counts)

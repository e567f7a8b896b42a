"""Distributed training with real gloo process groups on CPU, against one plain process.

The reference is the trainer on one process without torchrun (no FSDP). Against it:
  - 2 ranks under torchrun (FSDP2, gradient accumulation, full activation checkpointing, async saves)
    must give the same per-step losses;
  - resuming that run's step-5 checkpoint on 1 process, with its step-10 checkpoint left incomplete,
    must continue with the reference losses (2 -> 1, and resume=auto skipping an incomplete save);
  - two `torchrun --nnodes=2` launchers (scripts/launch_multinode.sh, c10d rendezvous on localhost, HSDP
    with 2 replicas, selective activation checkpointing) resuming the reference's step-5 checkpoint
    must finish the run with the reference losses (1 -> 2).
In-process tests cover interrupted and asynchronous saves and what activation checkpointing recomputes.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.checkpoint.manager import CheckpointManager, ModelState, OptimizerState
from scalevec_train.errors import ScalevecError
from scalevec_train.model import ModelConfig, Transformer
from scalevec_train.model.strategies import ScaleConfig
from scalevec_train.parallel.config import DistributedConfig
from scalevec_train.parallel.fsdp import mesh_shape
from scalevec_train.parallel.wrap import wrap_block
from tests.helpers import REPO

STEPS, SAVE_EVERY = 10, 5
# A global batch of 4 sequences per step; each launch picks micro_batch (and so the accumulation).
TINY = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "model.n_layers=2",
        "train.seq_len=32", "train.global_batch=4", "train.eval_batches=2", f"train.eval_every={SAVE_EVERY}",
        "schedule.warmup_steps=2", f"train.steps={STEPS}", "train.log_every=1",
        f"checkpoint.every={SAVE_EVERY}"]
LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch(command: list[str], cwd: Path, env: dict | None = None, timeout: int = 240) -> None:
    proc = subprocess.run(command, cwd=cwd, env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def train_command(nproc: int, *overrides: str) -> list[str]:
    """python -m scalevec_train.train (1 process, no torchrun) or torchrun with nproc processes."""
    if nproc == 1:
        return [sys.executable, "-m", "scalevec_train.train", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "scalevec_train.train", *overrides]


def losses(run_dir: Path, skip_lines: int = 0) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[skip_lines:]
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def line_count(run_dir: Path) -> int:
    return len((run_dir / "metrics.jsonl").read_text().splitlines())


def assert_same_losses(got: dict[int, float], expected: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=0), step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_run(src: Path, dst: Path, keep_step: int) -> Path:
    """A copy of run `src` whose checkpoints after `keep_step` are left incomplete (marker removed)."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > keep_step:
            (ckpt / checkpoint_files.COMPLETE).unlink()
    return dst


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    return [*data_overrides, *TINY]


@pytest.fixture(scope="module")
def reference(common, tmp_path_factory) -> Path:
    """One process, no torchrun, no FSDP: micro_batch 2, so 2 accumulation steps. resume=auto on a
    fresh run_dir starts from scratch."""
    run_dir = tmp_path_factory.mktemp("dist") / "reference"
    launch(train_command(1, *common, "train.micro_batch=2", f"run_dir={run_dir}", "resume=auto"),
           cwd=run_dir.parent)
    return run_dir


@pytest.fixture(scope="module")
def two_ranks(common, tmp_path_factory) -> Path:
    """torchrun, 2 ranks, FSDP2: micro_batch 1, so 2 accumulation steps per rank (no gradient sync on
    the first), full activation checkpointing, asynchronous saves."""
    run_dir = tmp_path_factory.mktemp("dist") / "two_ranks"
    launch(train_command(2, *common, "train.micro_batch=1", f"run_dir={run_dir}",
                         "distributed.activation_checkpointing=full", "checkpoint.async_save=true"),
           cwd=run_dir.parent)
    return run_dir


def test_two_ranks_give_the_losses_of_one_process(reference, two_ranks):
    expected = losses(reference)
    assert_same_losses(losses(two_ranks), expected, range(1, STEPS + 1))
    assert expected[STEPS] < expected[1] - 0.2  # it trains
    saved = checkpoint_files.complete_checkpoints(two_ranks)
    assert [p.name for p in saved] == ["step_000005", "step_000010"]
    assert sorted(p.name for p in saved[0].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert checkpoint_files.read_train_state(saved[0])["world_size"] == 2
    assert not list((two_ranks / "checkpoints").glob(".tmp*"))


def test_resume_two_ranks_on_one_process_skipping_an_incomplete_checkpoint(common, reference, two_ranks,
                                                                          tmp_path):
    run_dir = copy_run(two_ranks, tmp_path / "two_to_one", keep_step=5)
    before = line_count(run_dir)
    launch(train_command(1, *common, "train.micro_batch=4", f"run_dir={run_dir}", "resume=auto"), cwd=tmp_path)
    assert_same_losses(losses(run_dir, skip_lines=before), losses(reference), range(SAVE_EVERY + 1, STEPS + 1))


def test_two_node_launch_resumes_a_one_process_checkpoint(common, reference, tmp_path):
    run_dir = copy_run(reference, tmp_path / "one_to_two_nodes", keep_step=5)
    before = line_count(run_dir)
    env = {**child_env(), "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "NPROC_PER_NODE": "1", "RDZV_ID": f"test-{os.getpid()}", "PYTHON": sys.executable}
    command = ["bash", str(REPO / "scripts" / "launch_multinode.sh"), *common, "train.micro_batch=1",
               f"run_dir={run_dir}", "resume=auto", "distributed.activation_checkpointing=selective"]
    nodes = [subprocess.Popen(command, cwd=tmp_path, env={**env, "NODE_RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, out in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-5000:]
    assert_same_losses(losses(run_dir, skip_lines=before), losses(reference), range(SAVE_EVERY + 1, STEPS + 1))
    assert checkpoint_files.read_train_state(run_dir / "checkpoints" / "step_000010")["world_size"] == 2


def test_resume_none_refuses_a_run_dir_with_checkpoints(reference):
    with pytest.raises(ScalevecError, match="resume=auto"):
        checkpoint_files.find_resume(reference, "none")


# In-process: checkpoint mechanics and activation checkpointing on a small model.

def small_model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
    model = Transformer(cfg, ScaleConfig())
    model.init_weights(seed)
    return model


def train_once(model: Transformer, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def manager(run_dir: Path, model, optimizer, async_save: bool = False) -> CheckpointManager:
    return CheckpointManager(run_dir, {"model": ModelState(model), "optim": OptimizerState(model, optimizer)},
                             records={}, info={}, keep_last=2, async_save=async_save)


def load_into(path: Path, model) -> None:
    """Load checkpoint `path` into `model` through a fresh optimizer, as a resume does."""
    manager(path.parent.parent, model, torch.optim.AdamW(model.parameters(), lr=1e-2)).load(
        path, checkpoint_files.read_train_state(path))


def test_interrupted_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_once(model, optimizer)
    saver = manager(tmp_path, model, optimizer)
    good = saver.save(5)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    train_once(model, optimizer)

    def crash(state, checkpoint_id):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(torch.distributed.checkpoint, "save", crash)
        with pytest.raises(OSError, match="disk full"):
            saver.save(10)
    assert checkpoint_files.find_resume(tmp_path, "auto") == good
    assert list((tmp_path / "checkpoints").glob(".tmp_step_000010_*"))  # the debris of the crash

    fresh = small_model(seed=1)
    load_into(good, fresh)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, at_save[name], rtol=0, atol=0)

    # The next save completes, clears the debris and keeps the newest keep_last checkpoints.
    saver.save(10)
    saver.save(15)
    names = [p.name for p in checkpoint_files.complete_checkpoints(tmp_path)]
    assert names == ["step_000010", "step_000015"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_async_save_is_visible_only_once_finished(tmp_path):
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_once(model, optimizer)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    saver = manager(tmp_path, model, optimizer, async_save=True)
    final = saver.save(3)
    assert not final.exists()  # not before the next sync point
    train_once(model, optimizer)  # training goes on while the write is in flight
    assert saver.finish() == final
    assert checkpoint_files.find_resume(tmp_path, "auto") == final
    fresh = small_model(seed=1)
    load_into(final, fresh)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, at_save[name], rtol=0, atol=0)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(ac: str) -> tuple[Counter, dict[str, torch.Tensor]]:
    """The aten ops the backward pass runs under activation checkpointing `ac`, and the gradients."""
    model = small_model()
    for block in model.layers:
        wrap_block(block, ac, compile_block=False)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    with OpCounter() as counter:
        loss.backward()
    return counter.counts, {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_what_it_should_and_keeps_gradients():
    none, grads = backward_ops("none")
    selective, grads_selective = backward_ops("selective")
    full, grads_full = backward_ops("full")
    mm, silu = torch.ops.aten.mm.default, torch.ops.aten.silu.default
    layers = 2
    assert none[silu] == 0
    # selective: element-wise work (SiLU) is recomputed, matmul outputs are not; full: both are (all
    # of q, k, v, o, gate, up; recomputation stops before `down`, whose output backward never reads).
    assert selective[silu] == layers and selective[mm] == none[mm]
    assert full[silu] == layers and full[mm] >= none[mm] + layers * 6
    for name, g in grads.items():
        torch.testing.assert_close(grads_selective[name], g, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grads_full[name], g, rtol=1e-6, atol=1e-7)


def test_mesh_shape(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert mesh_shape(DistributedConfig(replicate=0), 8) == (2, 4)  # one replica group per node
    assert mesh_shape(DistributedConfig(replicate=1), 8) == (1, 8)
    assert mesh_shape(DistributedConfig(replicate=8), 8) == (8, 1)
    with pytest.raises(ScalevecError, match="distributed.replicate"):
        mesh_shape(DistributedConfig(replicate=3), 8)

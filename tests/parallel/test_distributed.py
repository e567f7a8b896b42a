"""Checkpoint mechanics and activation checkpointing, in-process on a small model: failed and
asynchronous saves, what each activation-checkpointing mode recomputes, and the HSDP mesh shape.
Training on several ranks against one process: test_world_sizes.py.
"""

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.checkpoint.manager import CheckpointManager, ModelState, OptimizerState
from scalevec_train.infra.errors import CheckpointWriteError, ScalevecError
from scalevec_train.infra.faults import FAULT_AT_ENV
from scalevec_train.model import ModelConfig, Transformer
from scalevec_train.model.config import ScaleConfig
from scalevec_train.parallel.config import DistributedConfig
from scalevec_train.parallel.data_parallel import mesh_shape
from scalevec_train.parallel.wrap import wrap_block


def small_model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      max_seq_len=16)
    model = Transformer(cfg, ScaleConfig())
    model.init_weights(seed)
    return model


def train_once(model: Transformer, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def manager(run_dir: Path, model, optimizer, async_save: bool = False) -> CheckpointManager:
    return CheckpointManager(run_dir, {"model": ModelState(model),
                                       "optim": OptimizerState(model, optimizer)},
                             records={}, info={}, keep_last=2, async_save=async_save)


def load_into(path: Path, model) -> None:
    """Load checkpoint `path` into `model` through a fresh optimizer, as a resume does."""
    manager(path.parent.parent, model, torch.optim.AdamW(model.parameters(), lr=1e-2)).load(
        path, checkpoint_files.read_train_state(path))


def test_a_failed_save_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_once(model, optimizer)
    saver = manager(tmp_path, model, optimizer)
    good = saver.save(5)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    train_once(model, optimizer)

    with monkeypatch.context() as m:
        m.setenv(FAULT_AT_ENV, "save.files:10=nospace")  # the shard file fails half written
        with pytest.raises(CheckpointWriteError,
                           match=r"step_000010: could not be written \(rank 0: OSError: "
                           r"\[Errno 28\] No space left on device"):
            saver.save(10)
    assert checkpoint_files.find_resume(tmp_path, "auto") == good
    # no partial folder
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000005"]

    fresh = small_model(seed=1)
    load_into(good, fresh)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, at_save[name], rtol=0, atol=0)

    # The next saves complete and keep the newest keep_last checkpoints.
    saver.save(10)
    saver.save(15)
    names = [p.name for p in checkpoint_files.complete_checkpoints(tmp_path)]
    assert names == ["step_000010", "step_000015"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_resume_none_refuses_a_run_dir_with_checkpoints(tmp_path):
    model = small_model()
    manager(tmp_path, model, torch.optim.AdamW(model.parameters(), lr=1e-2)).save(1)
    with pytest.raises(ScalevecError, match="resume=auto"):
        checkpoint_files.find_resume(tmp_path, "none")


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
    """The aten ops the backward pass runs under activation checkpointing `ac`, and the
    gradients."""
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
    # of q, k, v, o, gate, up; recomputation stops before `down`, whose output backward never
    # reads).
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

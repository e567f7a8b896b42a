"""optim=muon end to end through the trainer: FSDP2 on 2 gloo ranks against 1 process, and a resume
of Muon state on another world size."""

import shutil

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.parallel.test_distributed import assert_same_losses, launch, losses, train_command

# One layer so that w_down's shape occurs once; ffn_dim 171 gives matrices whose rows (171) do not
# divide by 2 ranks. fp32 Newton-Schulz so that 1 and 2 processes compute the same numbers.
MUON = ["optim=muon", "optim.ns_dtype=float32", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=171", "model.n_layers=1", "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2",
        "train.eval_batches=2", "schedule.warmup_steps=1", "train.steps=5", "train.log_every=1",
        "checkpoint.every=3", "checkpoint.keep_last=5"]


def final_model(run_dir, tmp_path, name) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / "step_000005", out)
    return torch.load(out, weights_only=True)["model"]


def test_muon_on_two_ranks_matches_one_process_and_resumes_across_world_sizes(tmp_path, data_overrides):
    common = [*data_overrides, *MUON]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    launch(train_command(1, *common, f"run_dir={one}"), tmp_path)
    launch(train_command(2, *common, f"run_dir={two}"), tmp_path)
    reference = losses(one)
    assert_same_losses(losses(two), reference, range(1, 6))
    a, b = final_model(one, tmp_path, "one"), final_model(two, tmp_path, "two")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5, msg=name)
    assert a["layers.0.ffn.w_gate.weight"].shape == (171, 64)

    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(two / "checkpoints" / "step_000003", resumed / "checkpoints" / "step_000003")
    launch(train_command(1, *common, f"run_dir={resumed}", "resume=auto"), tmp_path)
    assert_same_losses(losses(resumed), reference, [4, 5])
    assert reference[5] < reference[1]

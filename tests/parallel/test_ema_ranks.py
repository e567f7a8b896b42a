"""The weight EMA on 2 gloo ranks (FSDP2: DTensor shards of the EMA, the replicated fp32 scale sites
whole): the run of one process, the same EMA; 4 steps, a resume and 4 more give the EMA of 8 steps
bit for bit; checkpoints of 1 process resume on 2 ranks and of 2 ranks on 1, the EMA resharded with
the model.
The MoE model with the unified strategy covers the sites and the routers' expert_bias. One group of
2 ranks (tests/support/launch.py train_spawned) trains every 2-rank run
(tests/support/train_many.py)."""

import re
import shutil
from pathlib import Path

import pytest
import torch

from scalevec_train.checkpoint.files import COMPLETE, step_dir
from scalevec_train.data import prepare_data
from scalevec_train.train import run
from tests.support.helpers import make_config
from tests.support.launch import assert_same_curve, checkpoint_state, curve, train_spawned
from tests.support.presets import TINY_MOE

STEPS, HALF = 8, 4
# every micro-batch is 2 sequences on any world size (the MoE balancing loss is per micro-batch)
RUN = [*TINY_MOE, "model.moe.expert_dim=32", "model.moe.num_experts=4", "scale=unified",
       "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2", "train.eval_batches=1",
       f"train.eval_every={HALF}", "train.log_every=1", "optim.lr=1e-2", "schedule=constant",
       "schedule.warmup_steps=1", f"checkpoint.every={HALF}", "checkpoint.keep_last=4",
       "train.ema.half_life_tokens=256", "device=cpu", "data.num_workers=1"]
# fp32 sums in another order over ranks and shards: about 1e-7 relative per step, grown by Adam's
# normalized steps to a few 1e-6 in 8 steps; a rank's shard missing from the EMA, or a step more or
# less in it, is off by about lr = 1e-2
ATOL = 2e-5
# as in test_world_sizes.py: sites whose magnitude the normalized maps after them cancel get
# rounding noise for gradients, which Adam turns into moves of up to lr per step, different on every
# world size
CANCELLED = re.compile(r"(attn_norm\.sites\.[qkv]|ffn_norm\.sites\.(gate|up))\.beta$")


def resumable_copy(run_dir: Path, dst: Path) -> Path:
    """A copy of `run_dir` whose checkpoints after step HALF are incomplete (resume=auto passes
    them)."""
    shutil.copytree(run_dir, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > HALF:
            (ckpt / COMPLETE).unlink()
    return dst


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ema_ranks")
    prepare_data(make_config(*data_overrides).data)  # once, not by 2 ranks at a time
    one = run(make_config(*data_overrides, *RUN, f"train.steps={STEPS}", f"run_dir={root / 'one'}"))
    one_to_two = resumable_copy(one, root / "one_to_two")
    common = [*data_overrides, *RUN]
    launch = [
        [*common, f"train.steps={STEPS}", f"run_dir={root / 'two'}"],
        # the constant schedule does not depend on train.steps: 4 steps, then 4 more
        [*common, f"train.steps={HALF}", f"run_dir={root / 'split'}"],
        [*common, f"train.steps={STEPS}", f"run_dir={root / 'split'}", "resume=auto"],
        [*common, f"train.steps={STEPS}", f"run_dir={one_to_two}", "resume=auto"],
    ]
    train_spawned(2, launch, root / "launch.json")
    two_to_one = resumable_copy(root / "two", root / "two_to_one")
    run(make_config(*data_overrides, *RUN, f"train.steps={STEPS}", f"run_dir={two_to_one}",
                    "resume=auto"))
    return {"one": one, "two": root / "two", "split": root / "split", "one_to_two": one_to_two,
            "two_to_one": two_to_one}


def ema(run_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    state = checkpoint_state(step_dir(run_dir, STEPS), scratch)["ema"]
    assert state["count"].item() == STEPS
    return state["weights"]


def assert_close_ema(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and any(k.endswith("expert_bias") for k in want)
    for name, value in want.items():
        atol = 2 * STEPS * 1e-2 if CANCELLED.search(name) else ATOL
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_two_ranks_keep_the_ema_of_one_process(runs, tmp_path):
    """And their training is the one process's: the EMA's evaluations (the weights swapped in and
    back, FSDP's gathered copies dropped) leave nothing behind on any rank."""
    assert_close_ema(ema(runs["two"], tmp_path), ema(runs["one"], tmp_path))
    for key in ("loss", "grad_norm", "val_loss", "val_loss_ema", "val_bpb_ema"):
        expected = curve(runs["one"], key)
        assert_same_curve(curve(runs["two"], key), expected, expected, what=key)
    assert (curve(runs["two"], "val_loss_ema")[STEPS]
            != pytest.approx(curve(runs["two"], "val_loss")[STEPS]))


def test_a_resume_on_two_ranks_continues_the_ema_bit_for_bit(runs, tmp_path):
    got, want = ema(runs["split"], tmp_path), ema(runs["two"], tmp_path)
    assert all(torch.equal(got[n], w) for n, w in want.items())
    assert curve(runs["split"], "val_loss_ema") == curve(runs["two"], "val_loss_ema")


@pytest.mark.parametrize("name,reference", [("one_to_two", "one"), ("two_to_one", "two")])
def test_the_ema_reshards_to_another_world_size(runs, tmp_path, name, reference):
    assert_close_ema(ema(runs[name], tmp_path), ema(runs[reference], tmp_path))
    expected = {s: v for s, v in curve(runs[reference], "val_loss_ema").items() if s > HALF}
    assert_same_curve({s: v for s, v in curve(runs[name], "val_loss_ema").items() if s > HALF},
                      expected, expected, what="val_loss_ema")

"""Checkpoints reshard across expert-parallel degrees: a run saved at one EP degree and
data-parallel size resumes at another and continues the uninterrupted one-process run (losses,
gradient norms, val_loss, final parameters and optimizer state, the expert biases exactly, the data
position).

The run is the trainer's (tests/support/train_many.py on spawned gloo ranks), a tiny MoE under
unified with per-expert sites and Muon, a global batch of 8 sequences in micro-batches of one, 4
steps with checkpoints at 2 and 4:
  reference      1 process (EP=1), uninterrupted;
  2 ranks EP=2   uninterrupted; and the reference's step-2 checkpoint resumed (EP 1 -> 2);
  4 ranks EP=2 x expert-FSDP 2: the 2-rank EP=2 run's step-2 checkpoint resumed (data-parallel size
                 2 -> 4), and the reference's (EP 1 -> 2 x 2);
  1 process      the 2-rank EP=2 run's step-2 checkpoint resumed (EP 2 -> 1).
"""

from pathlib import Path

import pytest
import torch

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.train import run
from tests.support.helpers import make_config
from tests.support.launch import (
    assert_same_curve,
    assert_same_tensors,
    copy_run,
    final_model,
    records,
    train_spawned,
    trained_state,
)
from tests.support.presets import TINY_MOE

STEPS, EVERY = 4, 2
COMMON = [*TINY_MOE, "train.seq_len=32", "train.global_batch=8", "train.micro_batch=1",
          "train.eval_batches=1", f"train.eval_every={EVERY}", "schedule.warmup_steps=1",
          f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every={EVERY}",
          "checkpoint.keep_last=5", "optim.lr=3e-3", "optim=muon", "optim.ns_dtype=float32",
          "scale=unified", "scale.per_expert=true", "model.moe.aux_loss_coef=0.01",
          "distributed.replicate=1"]
# As tests/parallel/test_world_sizes.py: losses within 1e-5 relative over a few steps of another
# summation order; parameters and optimizer state within 1e-5, except the magnitudes whose every map
# is normalized right after (their gradient is rounding noise; Adam moves them by up to the LR per
# step).
ATOL, NOISE_ATOL = 1e-5, 2 * STEPS * 3e-3
NOISE = (".sites.q.beta", ".sites.k.beta", ".sites.v.beta", ".sites.gate.beta", ".sites.up.beta",
         "gate_in.beta", "up_in.beta")


def ep(n: int) -> str:
    return f"distributed.expert_parallel={n}"


def assert_continues(run_dir: Path, reference: Path, scratch: Path, skip: int) -> None:
    """The records after the first `skip` lines (the resumed run's) and the final state, against the
    uninterrupted reference's."""
    got = records(run_dir)[skip:]
    for key in ("loss", "grad_norm", "val_loss"):
        expected = {r["step"]: r[key] for r in records(reference) if key in r and r["step"] > EVERY}
        assert_same_curve({r["step"]: r[key] for r in got if key in r}, expected, expected,
                          what=key)
    final = [trained_state(checkpoint_files.step_dir(d, STEPS), scratch)
             for d in (run_dir, reference)]
    assert final[0].keys() == final[1].keys()
    for name, value in final[1].items():
        if name.endswith("expert_bias"):
            assert_same_tensors({name: final[0][name]}, {name: value}, atol=0)
        elif value.is_floating_point():
            atol = NOISE_ATOL if any(k in name for k in NOISE) else ATOL
            assert_same_tensors({name: final[0][name]}, {name: value}, atol=atol)
        else:
            assert final[0][name].equal(value), name
    states = [checkpoint_files.read_train_state(checkpoint_files.step_dir(d, STEPS))
              for d in (run_dir, reference)]
    assert states[0]["loader"] == states[1]["loader"]  # the data position


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ep_resume")
    prepare_data(make_config(*data_overrides).data)
    run(make_config(*data_overrides, *COMMON, f"run_dir={root / 'reference'}"))
    copy_run(root / "reference", root / "one_to_two", keep_step=EVERY)
    train_spawned(2, [
        [*data_overrides, *COMMON, ep(2), f"run_dir={root / 'two'}"],
        [*data_overrides, *COMMON, ep(2), f"run_dir={root / 'one_to_two'}", "resume=auto"],
    ], root / "two.json")
    copy_run(root / "two", root / "two_to_four", keep_step=EVERY)
    copy_run(root / "reference", root / "one_to_four", keep_step=EVERY)
    train_spawned(4, [
        [*data_overrides, *COMMON, ep(2), f"run_dir={root / name}", "resume=auto"]
        for name in ("two_to_four", "one_to_four")], root / "four.json")
    copy_run(root / "two", root / "two_to_one", keep_step=EVERY)
    run(make_config(*data_overrides, *COMMON, f"run_dir={root / 'two_to_one'}", "resume=auto"))
    return root


def test_expert_parallel_run_is_the_reference_and_each_rank_holds_its_experts(runs, tmp_path):
    ref = records(runs / "reference")
    for key in ("loss", "grad_norm", "val_loss"):
        expected = {r["step"]: r[key] for r in ref if key in r}
        assert_same_curve({r["step"]: r[key] for r in records(runs / "two") if key in r}, expected,
                          expected, what=key)
    # rank r = (expert-FSDP index i, EP index j), r = 2 i + j: EP rank j holds experts
    # [4 j, 4 j + 4) of 8, of which FSDP gives shard i half
    for name, world in (("two", 2), ("two_to_four", 4)):
        final = final_model(runs / name, STEPS, tmp_path)
        experts = [n for n in final if ".experts.w_" in n]
        assert len(experts) == 6
        for r in range(world):
            held = torch.load(runs / name / f"rank{r}.pt", weights_only=True)["shards"]
            i, j = divmod(r, 2)
            per_rank = 8 // world
            first = 4 * j + per_rank * i
            for n in experts:
                assert torch.equal(held[n], final[n][first:first + per_rank]), (name, r, n)


@pytest.mark.parametrize("name", ["one_to_two", "two_to_four", "one_to_four", "two_to_one"])
def test_resume_across_expert_parallel_degrees(name, runs, tmp_path):
    source = "reference" if name.startswith("one") else "two"
    skip = len(records(runs / source))  # the copied lines; the resumed run's follow
    assert_continues(runs / name, runs / "reference", tmp_path, skip)
    world = {"one_to_two": 2, "two_to_four": 4, "one_to_four": 4, "two_to_one": 1}[name]
    assert checkpoint_files.read_train_state(
        checkpoint_files.step_dir(runs / name, STEPS))["world_size"] == world

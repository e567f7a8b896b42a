"""Any world size computes the same run: the trainer on 4 and 2 gloo ranks (FSDP2, HSDP) against one
process.

The reference of every configuration is one plain process without torchrun (the trainer in this
process). Each multi-rank group trains several runs one after the other
(tests/support/train_many.py, its ranks forked by tests/support/launch.py's spawn, not started by
torchrun), so that its processes start once:
  4 ranks: dense (a shrunk dense-tiny) under {baseline, unified} x {adamw, muon} x {FSDP over 4,
           HSDP (2, 2)}, and a shrunk moe-tiny (load-balancing and z losses on, Muon on the
           experts);
  2 ranks: resumes of 4-rank checkpoints, moe-tiny again, a run with gradient accumulation, full
           activation checkpointing and asynchronous saves, and bf16 with FSDP mixed precision.
Every run must give the reference's losses, gradient norms, val_loss and final parameters (the MoE
expert biases included), and its scale sites, which FSDP leaves whole on every rank, must hold the
same values on every rank. Resumes 4 -> 2, 4 -> 1, 2 -> 1 and, through scripts/launch_multinode.sh,
1 -> 2 nodes must continue with the reference's numbers.
"""

import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.model import Transformer
from scalevec_train.model.strategies import scale_sites
from scalevec_train.train import run
from tests.support.helpers import REPO, make_config
from tests.support.launch import (
    assert_same_curve,
    assert_same_tensors,
    child_env,
    copy_run,
    final_model,
    records,
    train_spawned,
)
from tests.support.presets import SMALL_MODEL

STEPS, EVERY, LR = 4, 2, 3e-3
COMMON = [*SMALL_MODEL, "train.seq_len=32",
          "train.global_batch=8", "train.micro_batch=2", "train.eval_batches=1",
          f"train.eval_every={EVERY}", "schedule.warmup_steps=1", f"train.steps={STEPS}",
          "train.log_every=1", f"checkpoint.every={EVERY}", "checkpoint.keep_last=5",
          f"optim.lr={LR}",
          # fp32 Newton-Schulz: in bf16 a rounding difference of the input flips bits of the update
          "optim.ns_dtype=float32"]
MODELS = {
    # ffn_dim 130: the 4 ranks hold 33, 33, 33 and 31 rows of w_gate and w_up (uneven shards)
    "dense": ["model=dense-tiny", "model.ffn_dim=130"],
    # every micro-batch is 2 sequences on any world size, so the load-balancing loss (on the counts
    # of one micro-batch) is the same function everywhere
    "moe": ["model=moe-tiny", "model.ffn_dim=64", "model.moe.expert_dim=32",
            "model.moe.aux_loss_coef=0.01"],
}
MESHES = {"fsdp": "distributed.replicate=1", "hsdp": "distributed.replicate=2"}
FOUR = [f"dense-{scale}-{optim}-{mesh}" for scale in ("baseline", "unified")
        for optim in ("adamw", "muon") for mesh in MESHES] + ["moe-unified-muon-fsdp"]
# Resumed from a 4-rank run's step-2 checkpoint, on 2 ranks in the 2-rank launch and on 1 here.
ON_TWO = ["dense-baseline-adamw-fsdp", "dense-unified-muon-hsdp"]
ON_ONE = ["dense-unified-adamw-hsdp", "moe-unified-muon-fsdp"]
# Under unified the q/k/v and gate/up input sites feed maps whose outputs are normalized, which
# cancels their magnitude (describe lists them): its gradient is rounding noise, which Adam's
# normalized step turns into moves of up to about lr per step, different on every world size.
CANCELLED = re.compile(r"(attn_norm\.sites\.[qkv]|ffn_norm\.sites\.(gate|up))\.beta$")
# Parameters: fp32 gradients summed in another order differ by about 1e-7 relative; Adam divides by
# their running RMS, so the small ones move by a few 1e-6 (observed up to 2e-6) in 4 steps. One
# rank's gradient missing or counted twice moves parameters by about lr = 3e-3.
ATOL = 1e-5
CANCELLED_ATOL = 2 * STEPS * LR
# bf16 on CPU: long enough for the loss to fall clearly, at a higher LR.
BF16 = ["train.dtype=bf16", "train.steps=12", "optim.lr=1e-2", "train.eval_every=0"]


def setup_overrides(name: str) -> list[str]:
    model, scale, optim, mesh = name.split("-")
    return [*COMMON, *MODELS[model], f"scale={scale}", f"optim={optim}", MESHES[mesh]]


def assert_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Parameters (and persistent buffers: the expert biases, exactly) against the reference's."""
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        # integer counts summed over ranks, then the same fp32 steps
        if name.endswith("expert_bias"):
            assert torch.equal(got[name], value), name
            continue
        atol = CANCELLED_ATOL if CANCELLED.search(name) else ATOL
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def assert_same_run(run_dir: Path, reference: Path, scratch: Path, skip: int = 0) -> None:
    """The records of `run_dir` after its first `skip` lines (those of a resumed run), and its final
    parameters, against the reference run's."""
    got = records(run_dir)[skip:]
    first = EVERY + 1 if skip else 0  # every resume here continues from the step-2 checkpoint
    for key in ("loss", "grad_norm", "val_loss"):
        expected = {r["step"]: r[key] for r in records(reference)
                    if key in r and r["step"] >= first}
        assert_same_curve({r["step"]: r[key] for r in got if key in r}, expected, expected,
                          what=key)
    assert_params(final_model(run_dir, STEPS, scratch), final_model(reference, STEPS, scratch))


def rank_files(run_dir: Path, world: int) -> list[dict]:
    """What each rank held whole at the end of the run (tests/support/train_many.py)."""
    return [torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]


def site_names(overrides: list[str]) -> set[str]:
    cfg = make_config(*overrides)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    return {f"{path}.{n}" for path, site in scale_sites(model) for n, _ in site.named_parameters()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("world_sizes")


@pytest.fixture(scope="module")
def reference(data_overrides, root):
    """name -> the run directory of its one-process reference (trained here on first use; the mesh
    part of the name does not matter)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        key = name.rsplit("-", 1)[0]
        if key not in done:
            done[key] = run(make_config(*data_overrides, *setup_overrides(name),
                                        f"run_dir={root / 'one' / key}"))
        return done[key]
    return get


@pytest.fixture(scope="module")
def four_ranks(data_overrides, root) -> Path:
    prepare_data(make_config(*data_overrides).data)  # here, once, rather than by 4 ranks at a time
    runs = [[*data_overrides, *setup_overrides(name), f"run_dir={root / 'four' / name}"]
            for name in FOUR]
    train_spawned(4, runs, root / "four.json")
    return root / "four"


@pytest.fixture(scope="module")
def two_ranks(data_overrides, root, four_ranks) -> Path:
    out = root / "two"
    out.mkdir()
    runs = []
    for name in ON_TWO:
        resumed = copy_run(four_ranks / name, out / name, keep_step=EVERY)
        runs.append([*data_overrides, *setup_overrides(name), f"run_dir={resumed}", "resume=auto"])
    runs += [
        [*data_overrides, *setup_overrides("moe-baseline-adamw-fsdp"), f"run_dir={out / 'moe'}"],
        # micro_batch 1: 4 accumulation steps per rank (gradients reduced on the last only)
        [*data_overrides, *setup_overrides("dense-baseline-adamw-fsdp"), "train.micro_batch=1",
         "distributed.activation_checkpointing=full", "checkpoint.async_save=true",
         f"run_dir={out / 'accum'}"],
        [*data_overrides, *setup_overrides("dense-unified-adamw-fsdp"), *BF16,
         f"run_dir={out / 'bf16'}"],
    ]
    train_spawned(2, runs, root / "two.json")
    return out


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks_give_the_run_of_one_process(name, four_ranks, reference, tmp_path):
    run_dir = four_ranks / name
    assert_same_run(run_dir, reference(name), tmp_path)
    assert checkpoint_files.read_train_state(
        checkpoint_files.step_dir(run_dir, STEPS))["world_size"] == 4
    ranks = rank_files(run_dir, 4)
    # FSDP shards every other parameter over the 4 ranks; HSDP over the 2 ranks of a replica group
    # (ranks 0, 1 and 2, 3), and each group holds all of it: the shards of a group, in order, are
    # the parameter.
    final = final_model(run_dir, STEPS, tmp_path)
    groups = [[0, 1, 2, 3]] if name.endswith("fsdp") else [[0, 1], [2, 3]]
    buffers = {n for n in final if n.endswith("expert_bias")}
    assert ranks[0]["shards"].keys() == final.keys() - ranks[0]["params"].keys() - buffers
    for group in groups:
        for n, shard in ranks[0]["shards"].items():
            assert torch.equal(torch.cat([ranks[r]["shards"][n] for r in group]), final[n]), n
            assert len(shard) == -(-len(final[n]) // len(group)), n
    # Every rank holds the scale sites whole, and the same values: their gradients are averaged in
    # one all-reduce, and every rank takes the same step.
    assert ranks[0]["params"].keys() == site_names(setup_overrides(name))
    for other in ranks[1:]:
        assert_same_tensors(other["params"], ranks[0]["params"], atol=0)
        assert_same_tensors(other["expert_bias"], ranks[0]["expert_bias"], atol=0)
    expected = final_model(reference(name), STEPS, tmp_path)
    assert_params(ranks[0]["params"], {n: expected[n] for n in ranks[0]["params"]})


def test_moe_balances_globally_on_two_and_four_ranks(four_ranks, two_ranks, reference, tmp_path):
    """The expert biases follow the loads summed over all ranks: they are the one-process biases
    (one rank's counts would give others), and they moved."""
    for run_dir, world in ((four_ranks / FOUR[-1], 4), (two_ranks / "moe", 2)):
        name = FOUR[-1] if world == 4 else "moe-baseline-adamw-fsdp"
        assert_same_run(run_dir, reference(name), tmp_path)
        biases = rank_files(run_dir, world)[0]["expert_bias"]
        assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases.values())


def test_resume_four_ranks_on_two_and_on_one(four_ranks, two_ranks, reference, data_overrides,
                                             tmp_path):
    for name in ON_TWO:
        assert_same_run(two_ranks / name, reference(name), tmp_path,
                        skip=len(records(four_ranks / name)))
    for name in ON_ONE:
        run_dir = copy_run(four_ranks / name, tmp_path / name, keep_step=EVERY)
        skip = len(records(run_dir))
        run(make_config(*data_overrides, *setup_overrides(name), f"run_dir={run_dir}",
                        "resume=auto"))
        assert_same_run(run_dir, reference(name), tmp_path, skip=skip)


def test_accumulation_full_checkpointing_async_saves_then_two_to_one(
        two_ranks, reference, data_overrides, tmp_path):
    name = "dense-baseline-adamw-fsdp"
    run_dir = two_ranks / "accum"
    assert_same_run(run_dir, reference(name), tmp_path)
    saved = checkpoint_files.complete_checkpoints(run_dir)
    assert [p.name for p in saved] == ["step_000002", "step_000004"]
    assert sorted(p.name for p in saved[0].glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list((run_dir / "checkpoints").glob(".tmp*"))
    # resume=auto passes over the incomplete step-4 checkpoint
    resumed = copy_run(run_dir, tmp_path / "two_to_one", keep_step=EVERY)
    skip = len(records(resumed))
    run(make_config(*data_overrides, *setup_overrides(name), "train.micro_batch=4",
                    f"run_dir={resumed}", "resume=auto"))
    assert_same_run(resumed, reference(name), tmp_path, skip=skip)


def test_two_node_launch_resumes_a_one_process_checkpoint(reference, data_overrides, processes,
                                                          tmp_path):
    """Two `torchrun --nnodes=2` launchers (scripts/launch_multinode.sh, c10d rendezvous, HSDP with
    a replica per node, selective activation checkpointing) finish the reference from its step-2
    checkpoint.
    The test hosts the rendezvous store on a port the system gave it, held until the launchers are
    done; both launchers join it as clients, as the script makes every node but node 0 do."""
    name = "dense-baseline-adamw-fsdp"
    run_dir = copy_run(reference(name), tmp_path / "one_to_two_nodes", keep_step=EVERY)
    skip = len(records(run_dir))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = child_env(NNODES="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                    NPROC_PER_NODE="1", RDZV_ID=f"test-{os.getpid()}", PYTHON=sys.executable)
    overrides = [o for o in setup_overrides(name) if not o.startswith("distributed.")]
    command = ["bash", str(REPO / "scripts" / "launch_multinode.sh"), *data_overrides, *overrides,
               f"run_dir={run_dir}", "resume=auto",
               "distributed.activation_checkpointing=selective"]
    nodes = [processes.start(command, tmp_path, env) for _ in range(2)]
    for node in nodes:
        assert node.wait() == 0, node.describe()
    assert_same_run(run_dir, reference(name), tmp_path, skip=skip)
    assert checkpoint_files.read_train_state(
        checkpoint_files.step_dir(run_dir, STEPS))["world_size"] == 2


def test_bf16_trains_with_autocast_on_one_process_and_mixed_precision_on_two_ranks(
        two_ranks, data_overrides, tmp_path):
    """train.dtype=bf16 on CPU: autocast on one process; on two ranks FSDP computes with bf16
    weights and keeps the scale sites fp32. Both train: the loss falls, no step is non-finite, and
    the sites move."""
    overrides = [*setup_overrides("dense-unified-adamw-fsdp"), *BF16]
    one = run(make_config(*data_overrides, *overrides, f"run_dir={tmp_path / 'bf16'}"))
    for run_dir in (one, two_ranks / "bf16"):
        logged = [r for r in records(run_dir) if r["step"] > 0]
        assert [r["step"] for r in logged] == list(range(1, 13))
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
                   and r["skipped_steps"] == 0 for r in logged)
        assert logged[-1]["loss"] < logged[0]["loss"] - 0.5
    ranks = rank_files(two_ranks / "bf16", 2)
    sites = ranks[0]["params"]
    assert sites.keys() == site_names(overrides)
    assert all(p.dtype == torch.float32 for p in sites.values())
    assert_same_tensors(ranks[1]["params"], sites, atol=0)
    moved = [n for n, p in sites.items() if not CANCELLED.search(n) and (p - 1).abs().max() > 1e-3]
    assert len(moved) == len([n for n in sites if not CANCELLED.search(n)])

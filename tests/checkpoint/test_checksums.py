"""Checkpoints that prove their bytes (checkpoint/integrity.py): a byte flipped in any file a save
writes is refused by a resume (1 process, and 2 gloo ranks with asynchronous saves), by
scalevec_train.load, by branch_from, average, export and evaluate, each naming the file and the
newest earlier checkpoint that verifies; the skip options read a trusted checkpoint; a checkpoint
written before checksums loads with a notice. The reference is the checkpoint's own bytes: the same
calls on the unflipped files succeed."""

import json
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from scalevec_train import average as average_cli
from scalevec_train import evaluate as evaluate_cli
from scalevec_train import export as export_cli
from scalevec_train import verify as verify_cli
from scalevec_train.checkpoint.averaging import average
from scalevec_train.checkpoint.files import COMPLETE, step_dir
from scalevec_train.checkpoint.integrity import CHECKSUMS
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.api import load
from scalevec_train.run.build import build
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config, run_main
from tests.support.launch import gloo_group, spawn
from tests.support.presets import TINY_MODEL

# A constant LR, so that a branch of any length may start from any checkpoint of the run.
RUN = [*TINY_MODEL, *SHORT_RUN, "schedule=constant", "train.steps=4", "train.log_every=2",
       "checkpoint.every=2", "checkpoint.keep_last=4"]
HEADER = (COMPLETE, CHECKSUMS)  # a flip in either shows as a mismatch of the two, named by either


@pytest.fixture(scope="module")
def trunk(data_overrides, tmp_path_factory) -> Path:
    """A 1-process run with complete checkpoints at steps 2 and 4."""
    return run(make_config(*data_overrides, *RUN,
                           f"run_dir={tmp_path_factory.mktemp('checksums') / 'run'}"))


@contextmanager
def flipped(path: Path, at: int, mask: int):
    """`path` with its byte `at` XORed with `mask` (nonzero) within the block, as it was after
    it."""
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[at] ^= mask
    path.write_bytes(bytes(damaged))
    try:
        yield
    finally:
        path.write_bytes(original)


def positions(path: Path, rng: random.Random, count: int) -> list[tuple[int, int]]:
    """(byte, mask) pairs: the first and last byte and `count` others, each with a random nonzero
    mask."""
    size = path.stat().st_size
    return [(at, rng.randrange(1, 256))
            for at in sorted({0, size - 1, *rng.sample(range(size), min(count, size))})]


def weight_byte(checkpoint: Path) -> tuple[Path, int]:
    """(the shard, a byte in the middle of the largest model tensor's values there): flipped, it
    changes one weight and nothing that a reader parses."""
    largest = max(load(checkpoint)[0].state_dict().values(), key=lambda t: t.numel())
    raw = largest.numpy().tobytes()
    shard = checkpoint / "__0_0.distcp"
    start = shard.read_bytes().find(raw)
    assert start > 0
    return shard, start + len(raw) // 2


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


def assert_refused(error: ScalevecError | str, file: Path, good: str) -> None:
    """The refusal names the flipped file (or, for the marker and the list, one of the two) and, in
    its fix, `good` as the newest earlier checkpoint that verifies."""
    text = str(error)
    named = text.split(": ", 1)[0]
    expected = {str(file.parent / n) for n in HEADER} if file.name in HEADER else {str(file)}
    assert named in expected, text
    fix = text.split(" Fix: ", 1)[1]
    assert good in fix and "(the newest earlier checkpoint that verifies)" in fix, text


def test_every_file_a_save_writes_is_recorded(trunk):
    for step in (2, 4):
        folder = step_dir(trunk, step)
        listed = json.loads((folder / CHECKSUMS).read_text())["files"]
        assert set(listed) == {p.name for p in folder.iterdir()} - set(HEADER)
        assert {".metadata", "__0_0.distcp", "rng_rank0.pt", "train_state.json"} <= set(listed)
        assert (folder / COMPLETE).read_text().startswith("xxh3_64 ")


def test_any_flipped_byte_is_refused_by_load_and_the_trusted_checkpoint_loads(trunk):
    """scalevec_train.load: every byte of the marker, and the first, last and 6 more bytes of every
    other file, each flipped alone."""
    rng = random.Random(48)
    newest, good = step_dir(trunk, 4), str(step_dir(trunk, 2))
    reference = load(trunk)[0].state_dict()
    files = sorted(p for p in newest.iterdir())
    assert len(files) == 6
    tried = 0
    for file in files:
        places = [(at, rng.randrange(1, 256)) for at in range(file.stat().st_size)] \
            if file.name == COMPLETE else positions(file, rng, 6)
        for at, mask in places:
            with flipped(file, at, mask), pytest.raises(ScalevecError) as refused:
                load(trunk)
            assert_refused(refused.value, file, good)
            tried += 1
    assert tried > 40
    with flipped(*weight_byte(newest), 0x10):
        trusted = load(trunk, verify=False)[0].state_dict()
    # the trusted load read the flipped byte as it is: the same model but for one weight
    assert sum((trusted[k] != v).sum().item() for k, v in reference.items()) == 1
    assert all(torch.equal(a, b) for a, b in zip(load(trunk)[0].state_dict().values(),
                                                 reference.values()))


def test_any_flipped_byte_is_refused_by_a_resume_on_one_process(trunk, data_overrides, capsys):
    rng = random.Random(7)
    newest, good = step_dir(trunk, 4), str(step_dir(trunk, 2))
    cfg = make_config(*data_overrides, *RUN, "train.steps=6", f"run_dir={trunk}", "resume=auto")
    before = snapshot(trunk)
    for file in sorted(newest.iterdir()):
        at, mask = positions(file, rng, 1)[-1]
        with flipped(file, at, mask), pytest.raises(ScalevecError) as refused:
            build(cfg)
        assert_refused(refused.value, file, good)
        assert str(refused.value).endswith("checkpoint.verify=false.")
    # nothing written: resume=auto did not fall back to step 2 on its own
    assert snapshot(trunk) == before
    with flipped(*weight_byte(newest), 0x10):
        trusted = build(make_config(*data_overrides, *RUN, "train.steps=6", f"run_dir={trunk}",
                                    "resume=auto", "checkpoint.verify=false"))
    assert trusted.continued[0] == 4 and trusted.continued[1] == newest


def _resume_two_ranks(rank: int, store: str, overrides: list[str],
                      flips: dict[str, tuple[float, int]], damaged_data: list[str],
                      out: str) -> None:
    """Trains a 2-rank run with asynchronous saves, then resumes it once per entry of `flips` (file
    name in the newest checkpoint: where in it as a fraction of its size, mask), rank 0 flipping the
    byte before and restoring it after, then starts a run with `damaged_data`; each rank writes what
    each attempt raised."""
    import torch.distributed as dist

    with gloo_group(store, rank, 2):
        run_dir = run(make_config(*overrides, world_size=2))
        resume = make_config(*overrides, "train.steps=6", "resume=auto", world_size=2)
        found = {}
        for name, (where, mask) in flips.items():
            file = step_dir(run_dir, 4) / name
            original = file.read_bytes()
            at = int(where * len(original))
            if rank == 0:
                file.write_bytes(original[:at] + bytes([original[at] ^ mask]) + original[at + 1:])
            dist.barrier()
            try:
                build(resume)
                found[name] = None
            except ScalevecError as e:
                found[name] = str(e)
            dist.barrier()
            if rank == 0:
                file.write_bytes(original)
            dist.barrier()
        try:
            build(make_config(*overrides, *damaged_data, world_size=2))
        except ScalevecError as e:
            found["data"] = str(e)
        Path(out, f"rank{rank}.json").write_text(json.dumps(found))


def test_any_flipped_byte_is_refused_by_a_resume_on_two_ranks(trunk, data_overrides, tmp_path):
    """And a flipped byte in the smaller token shard, which only rank 1 reads (the ranks share the
    shards, the largest first), refuses a run on both ranks."""
    run_dir = tmp_path / "run"
    overrides = [*data_overrides, *RUN, "train.micro_batch=2", "checkpoint.async_save=true",
                 f"run_dir={run_dir}"]
    cache = shutil.copytree(next(o.split("=", 1)[1] for o in data_overrides
                                 if o.startswith("data.cache_dir=")),
                            tmp_path / "cache")
    shards = sorted(Path(cache).glob("text_dir-*/*/*.bin"), key=lambda p: p.stat().st_size)
    assert len(shards) == 2
    shards[0].write_bytes(bytes([shards[0].read_bytes()[0] ^ 0x01]) + shards[0].read_bytes()[1:])
    damaged_data = [f"data.cache_dir={cache}", f"run_dir={tmp_path / 'fresh'}"]
    # the files a 2-rank save writes (both ranks' shards and RNG states), each flipped at a random
    # byte
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt",
             "train_state.json", CHECKSUMS, COMPLETE]
    rng = random.Random(2)
    flips = {name: (rng.random(), rng.randrange(1, 256)) for name in names}
    spawn(_resume_two_ranks, (str(tmp_path / "store"), overrides, flips, damaged_data,
                              str(tmp_path)), nprocs=2)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert found[0] == found[1]  # the same refusal on both ranks
    assert found[0].pop("data").startswith(f"{shards[0]}: does not match the checksum its "
                                           "manifest recorded")
    assert set(found[0]) == set(names) == {p.name for p in step_dir(run_dir, 4).iterdir()}
    for name, error in found[0].items():
        assert error is not None, name
        assert_refused(error, step_dir(run_dir, 4) / name, str(step_dir(run_dir, 2)))


def test_branch_from_average_export_and_evaluate_refuse_and_trust_on_request(trunk, data_overrides,
                                                                             tmp_path):
    shard, at = weight_byte(step_dir(trunk, 4))
    good = str(step_dir(trunk, 2))
    branch = [*data_overrides, *RUN, "train.steps=6", f"branch_from={trunk}",
              f"run_dir={tmp_path / 'branch'}"]
    with flipped(shard, at, 0x01):
        with pytest.raises(ScalevecError) as refused:
            build(make_config(*branch))
        assert_refused(refused.value, shard, good)
        assert f"branch_from={good} (the newest" in str(refused.value)
        assert (build(make_config(*branch, "checkpoint.verify=false")).branched_from
                == step_dir(trunk, 4))

        with pytest.raises(ScalevecError) as refused:
            average(trunk, tmp_path / "avg", last=2)
        assert_refused(refused.value, shard, f"up to {step_dir(trunk, 2).name} (steps=")
        assert not (tmp_path / "avg").exists()
        trusted = run_main(average_cli.main, trunk, "last=2", f"out={tmp_path / 'avg'}",
                           "verify=false")
        assert trusted.returncode == 0 and (tmp_path / "avg").is_dir(), trusted

        refused = run_main(export_cli.main, trunk, f"out={tmp_path / 'hf'}")
        assert (refused.returncode == 2
                and refused.stderr.startswith(f"error: {shard}: does not match")), refused
        assert not (tmp_path / "hf").exists()
        assert run_main(export_cli.main, trunk, f"out={tmp_path / 'hf'}",
                        "verify=false").returncode == 0

        refused = run_main(evaluate_cli.main, trunk)
        assert (refused.returncode == 2
                and refused.stderr.startswith(f"error: {shard}: does not match")), refused
        assert "val_loss" in run_main(evaluate_cli.main, trunk, "verify=false").stdout
    # the average records its own files' checksums: it verifies, and is refused once damaged
    assert run_main(verify_cli.main, tmp_path / "avg").stdout.startswith("ok ")
    with flipped(tmp_path / "avg" / "config.yaml", 3, 0x20), \
            pytest.raises(ScalevecError) as refused:
        load(tmp_path / "avg")
    assert str(refused.value).startswith(f"{tmp_path / 'avg' / 'config.yaml'}: does not match")


def test_a_checkpoint_without_checksums_loads_and_resumes_with_a_notice(trunk, data_overrides,
                                                                        tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(trunk, old)
    for step in (2, 4):  # as written before checksums were recorded
        (step_dir(old, step) / COMPLETE).write_text("")
        (step_dir(old, step) / CHECKSUMS).unlink()
    capsys.readouterr()
    model, _ = load(old)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 load(trunk)[0].state_dict().values()))
    notice = f"note: {step_dir(old, 4)} records no checksums (written before scalevec recorded " \
             "them): its files are read unverified.\n"
    assert capsys.readouterr().err == notice
    built = build(make_config(*data_overrides, *RUN, "train.steps=6", f"run_dir={old}",
                              "resume=auto"))
    assert built.continued[0] == 4 and notice in capsys.readouterr().err
    listed = run_main(verify_cli.main, old)
    assert listed.returncode == 0 and listed.stdout.splitlines() == [
        f"no checksums  {step_dir(old, s)}  (written before checksums were recorded)"
        for s in (2, 4)]


def test_verify_prints_a_line_per_checkpoint_and_fails_on_a_mismatch(trunk):
    clean = run_main(verify_cli.main, trunk)
    assert clean.returncode == 0
    lines = clean.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["ok", str(step_dir(trunk, s))] for s in (2, 4)]
    rng_file = step_dir(trunk, 2) / "rng_rank0.pt"
    with flipped(rng_file, 100, 0x04):
        damaged = run_main(verify_cli.main, trunk)
    assert damaged.returncode == 1
    assert damaged.stdout.splitlines()[0].startswith(f"MISMATCH      {rng_file}: does not match "
                                                     "the checksum")
    assert damaged.stdout.splitlines()[1] == lines[1]
    assert run_main(verify_cli.main, step_dir(trunk, 4)).stdout.splitlines() == lines[1:]
    assert run_main(verify_cli.main, trunk / "nothing").returncode == 2

"""A resume or a branch compares the config of the run that wrote its checkpoint with its own
(scalevec_train/run/resume.py): a change of a key that defines the trajectory is refused, naming the
key, both values and the fix; `resume_changes` lets a change through on purpose; operational keys
and a longer run whose past learning rates stay the same pass; every change is printed and kept in
resumes.jsonl; a resume with nothing changed continues bit for bit and writes no resumes.jsonl."""

import json
import shutil

import pytest

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run.resume import read_resumes
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.launch import records
from tests.support.presets import TINY_MODEL

RUN = [*TINY_MODEL, *SHORT_RUN, "train.log_every=1", "checkpoint.every=3", "checkpoint.keep_last=3"]


@pytest.fixture(scope="module")
def trunk(data_overrides, tmp_path_factory):
    """A constant-LR run of 6 steps (a longer one keeps every past LR) and a cosine one."""
    root = tmp_path_factory.mktemp("continuation")
    return {name: run(make_config(*data_overrides, *RUN, "train.steps=6", f"schedule={name}",
                                  f"run_dir={root / name}"))
            for name in ("constant", "cosine")}


def numbers(run_dir) -> list[dict]:
    """What a run computed, step by step (its timings left out)."""
    return [{k: r[k] for k in ("step", "loss", "grad_norm", "val_loss") if k in r}
            for r in records(run_dir)]


def copy(run_dir, tmp_path, step: int | None = None):
    """A copy of a finished run to resume (its checkpoints after `step` dropped)."""
    dest = tmp_path / run_dir.name
    shutil.copytree(run_dir, dest)
    if step is not None:
        for d in (dest / "checkpoints").iterdir():
            if int(d.name.split("_")[1]) > step:
                shutil.rmtree(d)
        kept = [r for r in records(dest) if r["step"] <= step]
        (dest / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return dest


def resume(data_overrides, run_dir, *overrides):
    schedule = run_dir.name
    return run(make_config(*data_overrides, *RUN, "train.steps=6", f"schedule={schedule}",
                           *overrides, f"run_dir={run_dir}", "resume=auto"))


@pytest.mark.parametrize("override,key,saved,given", [
    ("optim.lr=0.01", "optim.lr", "0.003", "0.01"),
    ("seed=1", "seed", "0", "1"),
    ("scale=unified", "scale.heterogeneity", "'shared'", "'per_branch'"),
    ("train.seq_len=16", "train.seq_len", "32", "16"),
    ("optim.scale_lr=0.01", "optim.scale_lr", "None", "0.01")])
def test_a_change_of_the_trajectory_is_refused_naming_the_key_and_both_values(data_overrides, trunk,
                                                                              tmp_path, override,
                                                                              key, saved, given):
    copied = copy(trunk["constant"], tmp_path, step=3)
    before = records(copied)
    with pytest.raises(ScalevecError) as refused:
        resume(data_overrides, copied, override)
    message = str(refused.value)
    assert f"{key}: {saved} there, {given} here" in message and "resume_changes=[" in message
    assert not (copied / "resumes.jsonl").exists() and records(copied) == before  # nothing written


def test_resume_changes_lets_a_change_through_on_purpose_and_keeps_it(data_overrides, trunk,
                                                                      tmp_path, capsys):
    copied = copy(trunk["constant"], tmp_path, step=3)
    resume(data_overrides, copied, "optim.lr=0.001", "resume_changes=[optim.lr]",
           "train.log_every=3")
    assert "optim.lr 0.003 -> 0.001 (on purpose)" in capsys.readouterr().err
    [entry] = read_resumes(copied)
    assert entry["step"] == 3 and entry["changes"]["optim.lr"] == {"from": 0.003, "to": 0.001,
                                                                   "kind": "deliberate"}
    assert entry["changes"]["train.log_every"] == {"from": 1, "to": 3, "kind": "operational"}
    # step 6, the log
    assert [r["lr"] for r in records(copied) if r["step"] > 3 and "lr" in r] == [0.001]


def test_a_longer_run_passes_while_every_past_lr_stays_the_same(data_overrides, trunk, tmp_path):
    longer = copy(trunk["constant"], tmp_path)
    resume(data_overrides, longer, "train.steps=9")
    [entry] = read_resumes(longer)
    assert entry["changes"] == {"train.steps": {"from": 6, "to": 9, "kind": "length"}}
    assert max(r["step"] for r in records(longer)) == 9
    # under cosine the LRs of steps already taken would change with the length: refused
    cosine = copy(trunk["cosine"], tmp_path)
    with pytest.raises(ScalevecError, match=r"train.steps: 6 there, 9 here"):
        resume(data_overrides, cosine, "train.steps=9")


def test_a_plain_resume_continues_bit_for_bit_and_records_nothing(data_overrides, trunk, tmp_path):
    copied = copy(trunk["constant"], tmp_path, step=3)
    resume(data_overrides, copied)
    assert numbers(copied) == numbers(trunk["constant"])
    assert not (copied / "resumes.jsonl").exists()


def test_an_unknown_key_in_resume_changes_is_refused(data_overrides):
    with pytest.raises(ScalevecError, match=r"resume_changes: names no option: "
                                            r"\['optim.learning_rate'\]"):
        make_config(*data_overrides, "resume_changes=[optim.learning_rate]")

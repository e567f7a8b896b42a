"""Checkpoint averaging: the averaged tensors against the elementwise mean of the three checkpoints
read independently (DCP's own dcp_to_torch_save), loading the average on 1 process
(scalevec_train.load, export) and on 2 gloo ranks into an FSDP-sharded model as a resume does, and
the errors of bad inputs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from scalevec_analysis.grouping import group_runs, summarize
from scalevec_analysis.runs import load_run_dir
from scalevec_train import average as average_cli
from scalevec_train import evaluate as evaluate_cli
from scalevec_train.checkpoint.averaging import average
from scalevec_train.checkpoint.files import COMPLETE, STATE_FILE, SafeReader, find_resume, step_dir
from scalevec_train.checkpoint.manager import ModelState
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.api import load, read_config
from scalevec_train.interop.hf_export import export
from scalevec_train.model import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.run.checkpoint_eval import evaluate
from scalevec_train.train import run
from scalevec_train.training.logger import read_records
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.launch import checkpoint_state, gloo_group, spawn
from tests.support.presets import TINY_MODEL

STEPS = [2, 4, 6]
RUN = [*TINY_MODEL, *SHORT_RUN, "train.steps=6", "train.log_every=6", "optim.lr=1e-2",
       "checkpoint.every=2", "checkpoint.keep_last=4"]
MOE = ["model=moe-tiny", "model.moe.num_experts=4", "model.moe.expert_dim=32", "model.ffn_dim=32"]
RUNS = {"dense": ["scale=baseline"], "moe-unified": [*MOE, "scale=unified"]}


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory) -> dict[str, Path]:
    """Run directories with complete checkpoints at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("average_runs")
    return {name: run(make_config(*data_overrides, *RUN, *extra, f"run_dir={root / name}"))
            for name, extra in RUNS.items()}


@pytest.fixture(scope="module")
def averaged(runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("averaged")
    return {name: average(run_dir, root / name, last=3) for name, run_dir in runs.items()}


def expected_mean(run_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The mean of the three checkpoints' model tensors, each checkpoint read on its own by DCP."""
    models = [checkpoint_state(step_dir(run_dir, s), scratch)["model"] for s in STEPS]
    return {k: (sum(m[k].double() for m in models) / 3).to(v.dtype) for k, v in models[-1].items()}


@pytest.mark.parametrize("name", RUNS)
def test_average_is_the_elementwise_mean(runs, averaged, tmp_path, name):
    want = expected_mean(runs[name], tmp_path)
    got = checkpoint_state(averaged[name], tmp_path)["model"]
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    last = checkpoint_state(step_dir(runs[name], 6), tmp_path)["model"]
    # training moved the weights between saves
    assert any(not torch.equal(got[k], last[k]) for k in got)
    if name == "moe-unified":  # the router's balancing bias is averaged with the weights
        biases = [k for k in got if k.endswith("expert_bias")]
        assert biases and any(not torch.equal(got[k], last[k]) for k in biases)
    state = json.loads((averaged[name] / STATE_FILE).read_text())
    assert state["step"] == 6 and state["averaged_from"]["steps"] == STEPS
    assert state["averaged_from"]["run_dir"] == str(runs[name].resolve())


@pytest.mark.parametrize("name", RUNS)
def test_load_reads_the_average_on_one_process(runs, averaged, tmp_path, name):
    want = expected_mean(runs[name], tmp_path)
    model, tokenizer = load(averaged[name])
    got = model.state_dict()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v.float(), rtol=0, atol=0, msg=k)
    assert tokenizer.encode("def f(x):")
    out = export(averaged[name], tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def _rank(rank: int, world: int, store: str, checkpoints: dict[str, str], out: str) -> None:
    with gloo_group(store, rank, world):
        for name, checkpoint in checkpoints.items():
            cfg = read_config(Path(checkpoint))
            with torch.device("meta"):
                model = Transformer(cfg.model, cfg.scale)
            model = parallelize(model, cfg.distributed, torch.device("cpu"), seed=1, dtype="fp32")
            assert type(model.layers[0].attn.wq.weight).__name__ == "DTensor"
            dcp.load({"model": ModelState(model)}, storage_reader=SafeReader(checkpoint))
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                    for k, v in model.state_dict().items()}
            torch.save(full, f"{out}/{name}-rank{rank}.pt")


@pytest.fixture(scope="module")
def loaded_on_two_ranks(averaged, tmp_path_factory) -> Path:
    """Each average loaded on 2 gloo ranks, one model after the other in one spawned group; the full
    tensors each rank then held, as <name>-rank<r>.pt."""
    out = tmp_path_factory.mktemp("two_ranks")
    checkpoints = {name: str(path) for name, path in averaged.items()}
    spawn(_rank, (2, str(out / "store"), checkpoints, str(out)))
    return out


@pytest.mark.parametrize("name", RUNS)
def test_two_ranks_load_the_average_into_sharded_models(runs, loaded_on_two_ranks, tmp_path, name):
    """Loaded as a resume loads (DCP into DTensor shards), the average holds the mean exactly on
    every rank."""
    want = expected_mean(runs[name], tmp_path)
    for rank in range(2):
        got = torch.load(loaded_on_two_ranks / f"{name}-rank{rank}.pt", weights_only=True)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v.float(), rtol=0, atol=0, msg=(rank, k))


def test_the_command_line_averages_named_steps(runs, averaged, tmp_path, capsys):
    assert average_cli.main([str(runs["dense"]), "steps=[2,4,6]", f"out={tmp_path / 'cli'}"]) == 0
    got = checkpoint_state(tmp_path / "cli", tmp_path)["model"]
    want = checkpoint_state(averaged["dense"], tmp_path)["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert average_cli.main([str(runs["dense"]), f"out={tmp_path / 'x'}"]) == 2
    assert (average_cli.main([str(runs["dense"]), "last=3", "steps=[2,4]", f"out={tmp_path / 'x'}"])
            == 2)
    assert "usage:" in capsys.readouterr().err


def test_bad_inputs_fail_with_their_own_messages(runs, averaged, tmp_path):
    dense = tmp_path / "dense"
    shutil.copytree(runs["dense"], dense)
    with pytest.raises(ScalevecError, match=r"is 5: averaging takes 2 up to the 3 complete "
                                            r"checkpoints"):
        average(dense, tmp_path / "a", last=5)
    with pytest.raises(ScalevecError, match="at least two distinct steps"):
        average(dense, tmp_path / "a", steps=[4, 4])
    with pytest.raises(ScalevecError, match="exists and is not an empty folder"):
        average(dense, averaged["moe-unified"], last=2)
    shutil.copytree(step_dir(runs["moe-unified"], 6), step_dir(dense, 8))
    with pytest.raises(ScalevecError, match=r"step_000004: was written by another model than "
                                            r".*step_000008"):
        average(dense, tmp_path / "a", last=3)
    (step_dir(dense, 4) / COMPLETE).unlink()
    with pytest.raises(ScalevecError, match="step_000004: is not a complete checkpoint"):
        average(dense, tmp_path / "a", steps=[2, 4, 6])
    with pytest.raises(ScalevecError, match="not a run directory"):
        average(step_dir(dense, 6), tmp_path / "a", last=2)
    assert not (tmp_path / "a").exists()


def test_resume_refuses_an_averaged_checkpoint(runs, averaged):
    with pytest.raises(ScalevecError, match="is an averaged checkpoint: it holds the model only"):
        find_resume(runs["dense"], str(averaged["dense"]))


def test_evaluate_records_the_average_for_compare_runs(runs, averaged, capsys):
    """The evaluator's val_loss of the run's last checkpoint is the trainer's own val_loss of that
    step (a second code path); an averaged folder gets a metrics record that compare_runs reads as a
    run of its own, labelled by its steps."""
    trained = [r for r in read_records(runs["dense"] / "metrics.jsonl") if "val_loss" in r]
    metrics, written = evaluate(step_dir(runs["dense"], 6))
    loss = metrics["val_loss"]
    assert written is None and trained[-1]["step"] == 6
    assert loss == pytest.approx(trained[-1]["val_loss"], rel=1e-6)
    assert evaluate_cli.main([str(averaged["dense"])]) == 0
    assert "val_loss" in capsys.readouterr().out
    source, average_run = load_run_dir(runs["dense"]), load_run_dir(averaged["dense"])
    assert [r["step"] for r in average_run.records] == [6]
    assert average_run.records[0]["tokens"] == trained[-1]["tokens"]
    assert 0 < average_run.records[0]["val_loss"] < trained[0]["val_loss"]
    groups = group_runs([source, average_run])
    assert [g.label for g in groups] == ["averaged=(unset)", "averaged=2,4,6"]
    summary = summarize(groups, groups[0])
    assert summary[1].terminal == average_run.records[0]["val_loss"]
    assert summary[1].delta == pytest.approx(average_run.records[0]["val_loss"]
                                             - trained[-1]["val_loss"])

"""Sweeps (Hydra multirun) whose points never share a run directory (scalevec_train/run/sweep.py and
its sweeper, hydra_plugins/scalevec_sweeper): each point's run_dir names every key the sweep varies
beyond those its name already tells apart, the same sweep again finds the same directories, and a
sweep whose points would share one refuses before anything is written. With Hydra's basic launcher,
with the joblib launcher (points in parallel processes), and the SLURM launcher's config composing
the same names."""

from pathlib import Path

import pytest
from hydra._internal.callbacks import Callbacks
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.types import HydraContext, RunMode
from omegaconf import OmegaConf

from scalevec_train.config import CONFIG_DIR
from tests.support.launch import latest_step, train_in_process
from tests.support.presets import TINY_MODEL

RUN = [*TINY_MODEL, "train.seq_len=32", "train.global_batch=2", "train.eval_batches=1",
       "train.eval_every=0", "train.steps=2", "schedule.warmup_steps=1", "device=cpu",
       "checkpoint.every=2"]
DEFAULT = "dense-tiny-baseline-adamw-cosine-s0"


def named_points(*arguments: str) -> list[list[str]]:
    """The points, with their overrides, that the sweeper of
    `python -m scalevec_train.train -m <arguments>` hands its launcher (the one the arguments
    choose, instantiated for real), without launching them."""
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONFIG_DIR))
    cfg = loader.load_configuration("config", list(arguments), RunMode.MULTIRUN)
    sweeper = Plugins.instance().instantiate_sweeper(
        hydra_context=HydraContext(config_loader=loader, callbacks=Callbacks(cfg)),
        task_function=lambda _: None, config=cfg)
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(
        [*(f"{k}={v}" for k, v in (cfg.hydra.sweeper.params or {}).items()),
         *cfg.hydra.overrides.task])
    (points,) = sweeper.split_arguments(overrides, None)
    return points


def run_dir_of(point: list[str]) -> str:
    (line,) = [o for o in point if o.startswith("run_dir=")]
    return line.removeprefix("run_dir=").strip("'")


def test_the_sweep_of_the_issue_writes_one_directory_per_learning_rate_and_reruns_into_them(
        data_overrides, tmp_path, capfd, monkeypatch):
    sweep = ["-m", "model=dense-tiny", "optim.lr=1e-3,3e-3", *data_overrides, *RUN]
    code, out = train_in_process(sweep, {}, tmp_path, capfd, monkeypatch)
    assert code == 0, out[-3000:]
    runs = tmp_path / "runs"
    dirs = {p.name: p for p in runs.iterdir() if p.is_dir()}
    assert sorted(dirs) == [f"{DEFAULT}-optim.lr_0.001", f"{DEFAULT}-optim.lr_0.003"]
    for name, d in dirs.items():
        assert OmegaConf.load(d / "config.yaml").optim.lr == float(name.rsplit("_", 1)[1])
        assert latest_step(d) == 2
    # the same sweep again continues its runs (finished here: nothing to train), in the same
    # directories
    code, out = train_in_process([*sweep, "resume=auto"], {}, tmp_path, capfd, monkeypatch)
    assert code == 0, out[-3000:]
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == sorted(dirs)
    assert sorted(line.split()[1] for line in out.splitlines() if line.startswith("run_dir: ")) == [
        f"runs/{name}" for name in sorted(dirs)]


def test_points_run_in_parallel_by_joblib_get_their_own_directories(data_overrides, tmp_path, capfd,
                                                                    monkeypatch):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=3",
             "train.z_loss=0,1e-4", *data_overrides, *RUN]
    code, out = train_in_process(sweep, {}, tmp_path, capfd, monkeypatch)
    assert code == 0, out[-3000:]
    dirs = sorted(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    stem = "dense-tiny-baseline-adamw-cosine-s3"
    assert [d.name for d in dirs] == [f"{stem}-train.z_loss_0.0", f"{stem}-train.z_loss_0.0001"]
    assert [OmegaConf.load(d / "config.yaml").train.z_loss for d in dirs] == [0.0, 1e-4]
    assert all(latest_step(d) == 2 for d in dirs)


def test_a_preset_run_dir_gains_the_keys_it_does_not_name_and_slurm_composes_the_same():
    points = named_points("+experiment=study_lr", "scale=unified", "seed=0", "train.z_loss=0,1e-4")
    # study_lr's run_dir names optim.lr already; the command line's z_loss is added, nothing else
    assert sorted(run_dir_of(p) for p in points) == [
        f"runs/study/dense-study-unified-adamw-cosine-lr{lr}-s0-train.z_loss_{z}"
        for lr in ("0.001", "0.01") for z in ("0.0", "0.0001")]
    assert named_points("+experiment=removal") == [  # names every key it varies: nothing added
        [f"scale={scale}", f"seed={seed}", "+experiment=removal"] for scale in ("none", "baseline")
        for seed in (0, 1, 2)]
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    slurm = named_points("+experiment=study_lr", "scale=unified", "seed=0", "train.z_loss=0,1e-4",
                         "hydra/launcher=slurm", "hydra.launcher.partition=gpu")
    # the launcher's own choice and options are Hydra's overrides, not the points'
    assert slurm == points



@pytest.mark.parametrize("sweep, message, fix", ids=["run_dir_given", "one_value_twice",
                                                     "values_read_alike"],
                         argvalues=[
    (["run_dir=runs/mine", "optim.lr=1e-3,3e-3", "seed=0,1"],
     "run_dir: the sweep's points [optim.lr=0.001 seed=0], [optim.lr=0.001 seed=1], "
     "[optim.lr=0.003 seed=0], [optim.lr=0.003 seed=1] would share runs/mine,",
     "Fix: name optim.lr, seed in run_dir (e.g. run_dir='runs/mine-${optim.lr}'), or leave "
     "run_dir out"),
    (["optim.lr=1e-3,0.001"], "run_dir: the sweep lists the point [optim.lr=0.001 ",
     "Fix: drop the repeated value."),
    (["tasks.dir=/data/a,/data_a"],
     f"run_dir: the sweep's points [tasks.dir=/data/a], [tasks.dir=/data_a] would share "
     f"runs/{DEFAULT}-tasks.dir_data_a,",
     "Fix: set run_dir to name tasks.dir yourself"),
])
def test_a_sweep_whose_points_would_share_a_run_dir_refuses_with_one_line_and_writes_nothing(
        sweep, message, fix, data_overrides, tmp_path, capfd, monkeypatch):
    code, out = train_in_process(["-m", *sweep, *data_overrides, *RUN], {}, tmp_path, capfd,
                                 monkeypatch)
    assert code == 2
    assert (out.startswith(f"error: {message}") and fix in out
            and len(out.strip().splitlines()) == 1), out
    assert list(Path(tmp_path).iterdir()) == []

"""Experiment presets compose and validate for every point of their sweep; wandb settings derive
from the config and nothing secret reaches the run directory."""

import itertools
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from scalevec_train.config import CONFIG_DIR
from scalevec_train.train import run
from scalevec_train.training.config import LoggerConfig
from scalevec_train.training.logger import wandb_init_args
from tests.support.helpers import make_config, make_configs

# study_base and ladder hold shared settings of scripts/run_study.sh; they are not sweeps by
# themselves.
EXPERIMENTS = sorted(p.stem for p in (Path(CONFIG_DIR) / "experiment").glob("*.yaml")
                     if p.stem not in ("study_base", "ladder"))


def sweep_points(experiment: str) -> list[list[str]]:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        raw = compose(config_name="config", overrides=[f"+experiment={experiment}"],
                      return_hydra_config=True)
    params = raw.hydra.sweeper.params
    axes = [[f"{key}={value}" for value in str(values).split(",")]
            for key, values in params.items()]
    return [list(point) for point in itertools.product(*axes)]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_sweep_point_composes_and_validates(experiment):
    points = sweep_points(experiment)
    assert len(points) >= 2
    run_dirs = set()
    # points that differ only in values (seed, lr, ...) share one compose of their config groups
    for cfg in make_configs([[f"+experiment={experiment}", *point] for point in points]):
        run_dirs.add(cfg.run_dir)
        assert cfg.run_dir.startswith("runs/study/" if experiment.startswith("study")
                                      else f"runs/{experiment}/")
        assert f"-s{cfg.seed}" in cfg.run_dir and cfg.scale.name in cfg.run_dir
    assert len(run_dirs) == len(points), "two runs of one sweep would share a run_dir"


def test_wandb_group_is_shared_by_seeds_only():
    def args(*overrides):
        cfg = make_config(*overrides)
        from omegaconf import OmegaConf

        return wandb_init_args(cfg.logger, OmegaConf.to_container(OmegaConf.structured(cfg)),
                               Path(cfg.run_dir))

    a, b = args("seed=0", "scale=unified"), args("seed=1", "scale=unified")
    c = args("seed=0", "scale=unified", "optim.lr=1e-3")
    assert a["group"] == b["group"] != c["group"]
    # tasks observe
    assert args("seed=0", "scale=unified", "tasks=embedded", "tasks.every=5")["group"] == a["group"]
    assert a["group"].startswith("dense-tiny-unified-adamw-cosine-")
    assert {"model=dense-tiny", "scale=unified", "optim=adamw", "schedule=cosine",
            "seed=0"} <= set(a["tags"])
    assert a["id"] != b["id"] and a["config"]["scale"]["reparam"] == "or"
    assert wandb_init_args(LoggerConfig(group="mine"), a["config"], Path("x"))["group"] == "mine"


def test_wandb_logger_runs_offline_without_leaking_the_key(tmp_path, data_overrides, monkeypatch):
    pytest.importorskip("wandb")
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = run(make_config(*data_overrides, "logger=wandb", "logger.mode=offline",
                          "logger.progress_bar=false", "model.n_layers=1", "train.steps=2",
                          "train.seq_len=32", "train.global_batch=4", "train.micro_batch=4",
                          "schedule.warmup_steps=1", f"run_dir={tmp_path / 'r'}"))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2
    assert list((out / "wandb").glob("offline-run-*"))
    for path in out.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        raw = compose(config_name="config",
                      overrides=["+experiment=unified", "hydra/launcher=slurm",
                                 "hydra.launcher.partition=gpu"], return_hydra_config=True)
    assert raw.hydra.launcher._target_.endswith("SlurmLauncher")
    assert raw.hydra.launcher.partition == "gpu" and raw.hydra.launcher.tasks_per_node == 8

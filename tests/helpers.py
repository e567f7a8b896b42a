"""Shared test utilities: composing configs the way the entry points do, loading or running a script,
writing a run directory as the trainer does."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from omegaconf import OmegaConf

from scalevec_train.config import Config, compose_config
from scalevec_train.data.loader import Batch

# the repository root (configs/, scripts/)
REPO = Path(__file__).resolve().parents[1]


def make_config(*overrides: str, world_size: int = 1) -> Config:
    return compose_config(list(overrides), world_size)


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """A script outside the packages (scripts/...) imported as a module, its main() not run."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    """scripts/<name> run in a child Python from the repository root, its output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO)


def write_run(root: Path, name: str, cfg: dict, rows: list[dict], params: float | None = None) -> Path:
    """A run directory as the trainer writes it: config.yaml, metrics.jsonl, and with `params`,
    describe.json's total_params."""
    d = root / name
    d.mkdir()
    OmegaConf.save(OmegaConf.create(cfg), d / "config.yaml")
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if params is not None:
        (d / "describe.json").write_text(json.dumps({"total_params": params, "layers": 2}))
    return d


# A few CPU steps of tiny batches: one evaluation batch, no periodic evaluation, one data worker.
SHORT_RUN = ["train.seq_len=32", "train.global_batch=4", "train.micro_batch=4", "train.eval_batches=1",
             "train.eval_every=0", "schedule.warmup_steps=1", "device=cpu", "data.num_workers=1"]


class ListLoader:
    """A loader that hands out the given batches in order (what a test trains the Trainer on directly)."""

    def __init__(self, batches: list[Batch]):
        self.batches = iter(batches)

    def next_batch(self) -> Batch:
        return next(self.batches)

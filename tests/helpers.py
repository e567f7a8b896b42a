"""Shared test utilities: composing configs the way the entry points do, loading a script as a module."""

import importlib.util
from pathlib import Path
from types import ModuleType

from scalevec_train.config import Config, compose_config

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

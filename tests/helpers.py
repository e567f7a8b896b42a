"""Shared test utilities: composing configs the way the entry points do."""

from pathlib import Path

from scalevec_train.config import Config, compose_config

# the repository root (configs/, scripts/)
REPO = Path(__file__).resolve().parents[1]


def make_config(*overrides: str, world_size: int = 1) -> Config:
    return compose_config(list(overrides), world_size)

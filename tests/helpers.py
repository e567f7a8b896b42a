"""Shared test utilities: composing configs the way the entry points do."""

from scalevec_train.config import Config, compose_config


def make_config(*overrides: str, world_size: int = 1) -> Config:
    return compose_config(list(overrides), world_size)

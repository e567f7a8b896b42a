"""Shared test utilities: composing configs the way the entry points do."""

from hydra import compose, initialize_config_dir

from scalevec_train.config import CONFIG_DIR, Config, to_config


def make_config(*overrides: str, world_size: int = 1) -> Config:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        raw = compose(config_name="config", overrides=list(overrides))
    return to_config(raw, world_size)

"""Config errors name the key and the fix, in-process and through the command line."""

import dataclasses
import functools
import subprocess
import sys

import pytest
from hydra.errors import HydraException

from scalevec_train.infra.errors import ScalevecError
from tests.support.helpers import make_config_shared

CASES = [
    (["model.dim=100", "model.n_heads=3"],
     "model.dim: hidden size 100 is not divisible by model.n_heads=3"),
    (["model.n_kv_heads=3"], "model.n_kv_heads: 3 does not divide n_heads=4"),
    (["train.seq_len=2048"],
     r"train.seq_len: 2048 is longer than the model's positions \(model.max_seq_len=1024\)"),
    (["train.global_batch=20", "train.micro_batch=8"],
     "train.global_batch: 20 sequences are not divisible"),
    (["+train.warmup=5"], "train.warmup: unknown key"),
    (["train.steps=many"], "train.steps"),
    (["scale.placement=sideways"], "scale.placement: unknown value 'sideways'"),
    (["scale.targets=[q,z]"], r"scale.targets: unknown linear maps \['z'\]"),
    (["schedule.warmup_steps=5000"], "schedule.warmup_steps"),
    (["optim.lr=-1"], r"optim.lr: -1.0 is not positive. Fix: use a learning rate > 0."),
    (["optim.weight_decay=-0.1"], r"optim.weight_decay: -0.1 is negative. Fix:"),
    (["optim=muon", "optim.momentum=1.0"],
     r"optim.momentum: 1.0 is outside \[0, 1\). Fix: use 0.95."),
    (["optim=muon", "optim.ns_steps=0"], r"optim.ns_steps: 0 is not a positive integer. Fix:"),
    (["optim.betas=[0.9,1.5]"], r"optim.betas: \[0.9, 1.5\] is not two numbers in \[0, 1\). Fix:"),
    (["optim.scale_lr=0"], r"optim.scale_lr: 0.0 is not positive. Fix: use null or a positive LR."),
    (["optim.scale_lr=fast"], "optim.scale_lr"),
    (["optim.scale_weight_decay=-0.1"],
     r"optim.scale_weight_decay: -0.1 is negative. Fix: use null"),
    (["optim.scale_lr=0.5", "optim.scale_weight_decay=2"],
     r"optim.scale_weight_decay: the scale sites' lr \* weight_decay = 1: .* Fix: lower "
     r"optim.scale_weight_decay"),
    (["optim.scale_lr=20"], r"optim.scale_lr: the scale sites' lr \* weight_decay = 2: "),
    (["scale.decay_final_norm=maybe"], "scale.decay_final_norm"),
    (["data.source=ftp"],
     "data.source: unknown value 'ftp'. Fix: use one of: stdlib, python_env, text_dir"),
    (["data.source=text_dir"], "data.path: data.source=text_dir needs a path"),
    (["device=tpu"], "device: unknown value 'tpu'. Fix: use one of: auto, cpu, cuda."),
    (["model.kernels=cuda"], "model.kernels: unknown value 'cuda'"),
    (["model.attention_mask=packed"], "model.attention_mask: unknown value 'packed'"),
    (["model.attention_backend=xformers"], "model.attention_backend: unknown value 'xformers'"),
    (["model.rope_reset=true"], "model.rope_reset: resets positions at document starts"),
    (["train.z_loss=-1e-4"], "train.z_loss: must not be negative"),
    (["train.dtype=fp8"], "train.dtype: unknown value 'fp8'"),
]


@pytest.mark.parametrize("overrides,message", CASES)
def test_config_error_names_key(overrides, message):
    with pytest.raises(ScalevecError, match=message) as info:
        make_config_shared(*overrides)
    assert info.value.where


def choice_keys(cfg, prefix: str = "") -> list[str]:
    """Every option of `cfg` (a config dataclass) declared with errors.choice, as dotted keys."""
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "choices" in f.metadata:
            keys.append(prefix + f.name)
        elif dataclasses.is_dataclass(value):
            keys += choice_keys(value, f"{prefix}{f.name}.")
    return keys


MOE_CONFIG = make_config_shared("model=moe-tiny")


@pytest.mark.parametrize("key", choice_keys(MOE_CONFIG))
def test_every_choice_refuses_an_unknown_value_naming_the_choices(key):
    *path, name = key.split(".")
    owner = functools.reduce(getattr, path, MOE_CONFIG)
    allowed = next(f.metadata["choices"] for f in dataclasses.fields(owner) if f.name == name)
    assert len(allowed) >= 2
    allowed = ", ".join(allowed)
    with pytest.raises(ScalevecError,
                       match=f"^{key}: unknown value 'bogus'. Fix: use one of: {allowed}.$"):
        make_config_shared("model=moe-tiny", f"{key}=bogus")


def test_choices_cover_the_options_that_name_a_mode():
    assert {"scale.placement", "scale.reparam", "model.moe.backend", "model.kernels", "optim.name",
            "optim.ns_dtype", "schedule.decay_shape", "data.source", "train.dtype",
            "distributed.activation_checkpointing", "device", "logger.name", "logger.mode",
            "model.attention_mask", "model.attention_backend"} <= set(choice_keys(MOE_CONFIG))


def test_global_batch_must_divide_by_world_size():
    with pytest.raises(ScalevecError,
                       match=r"train.global_batch: 16 sequences cannot be split "
                             r"evenly over 3 ranks"):
        make_config_shared(world_size=3)
    with pytest.raises(ScalevecError, match=r"micro_batch \* ranks = 16 \* 2"):
        make_config_shared("train.micro_batch=16", world_size=2)


def test_unknown_preset_is_refused_with_the_options():
    with pytest.raises(HydraException, match="dense-tiny"):
        make_config_shared("model=dense-huge")


def test_defaults_compose_and_validate():
    cfg = make_config_shared()
    assert (cfg.model.name, cfg.scale.name, cfg.optim.name, cfg.schedule.name) == (
        "dense-tiny", "baseline", "adamw", "cosine")
    assert cfg.run_dir == "runs/dense-tiny-baseline-adamw-cosine-s0"


def test_command_line_errors_exit_nonzero_with_one_message(tmp_path):
    run = subprocess.run([sys.executable, "-m", "scalevec_train.train", "model.dim=100",
                          "model.n_heads=3",
                          f"run_dir={tmp_path / 'r'}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "model.dim: hidden size 100 is not divisible" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "r").exists()

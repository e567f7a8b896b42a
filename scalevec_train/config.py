"""The typed root config: Hydra composes YAML from configs/, this module turns it into dataclasses
and validates it before any expensive work. Each component's options live next to the component.

The dataclasses are the one source of every option's default and documentation. Hydra composes on
top of those defaults (registered as `scalevec_defaults`, untyped, so that every option can be
overridden with `key=value` and this module's checks give the one-line errors); presets set only
what differs."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from scalevec_train.checkpoint.config import CheckpointConfig
from scalevec_train.data.config import DataConfig
from scalevec_train.infra.errors import ScalevecError, check_choices, choice
from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.optim.config import OptimConfig, ScheduleConfig
from scalevec_train.parallel.config import DistributedConfig
from scalevec_train.parallel.data_parallel import mesh_shape
from scalevec_train.parallel.expert_parallel import check as check_expert_parallel
from scalevec_train.tasks.config import TasksConfig
from scalevec_train.training.config import LoggerConfig, TrainConfig

# configs/ at the repository root (the package is installed in editable mode next to it).
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    # seeds model init, data order and everything random
    seed: int = 0
    # where metrics.jsonl, config.yaml and checkpoints/ go; the default name says what the run is
    run_dir: str = "runs/${model.name}-${scale.name}-${optim.name}-${schedule.name}-s${seed}"
    # none: start fresh (refuses a run_dir that already holds checkpoints) | auto: continue from the
    # newest complete checkpoint in run_dir if there is one | a checkpoint directory path
    resume: str = "none"
    # keys that define the trajectory (continuation.py) which this resume or branch changes on
    # purpose, e.g. [optim.lr] after a spike; any other such change is refused, naming the keys
    resume_changes: list[str] = field(default_factory=list)
    # a Hugging Face Llama folder (config.json + safetensors) whose weights start a fresh run under
    # any dense model and strategy; empty: random initialization. A resumed run takes its checkpoint
    # instead.
    init_from: str = ""
    # a run directory or checkpoint of another run (the trunk) to branch from: this run starts from
    # its weights, optimizer state and data position in its own run_dir, and decays to its own
    # train.steps (scalevec_train/run/branch.py: which checkpoint, what must match); empty: no
    # branch
    branch_from: str = ""
    # auto (cuda if available) | cpu | cuda
    device: str = choice("auto", Literal["auto", "cpu", "cuda"])

    def validate(self, world_size: int = 1) -> None:
        self.model.validate()
        self.scale.validate()
        self.optim.validate()
        self.train.validate(world_size)
        self.schedule.validate(self.train.steps)
        self.data.validate()
        self.logger.validate()
        self.checkpoint.validate()
        self.distributed.validate()
        if self.distributed.expert_parallel > 1:
            moe = self.model.moe
            check_expert_parallel(self.distributed, None if moe is None else moe.num_experts,
                                  world_size, mesh_shape(self.distributed, world_size)[0])
        self.tasks.validate()
        if (self.model.parameterization == "mup" and self.optim.name == "muon"
                and self.optim.muon_router):
            raise ScalevecError("optim.muon_router", "under model.parameterization=mup the router "
                                "is a readout (its logits scaled by 1 / m_N), whose rule is "
                                "AdamW's (docs/concepts/parameterization.md).",
                                "set optim.muon_router=false.")
        if self.train.seq_len > self.model.max_seq_len:
            raise ScalevecError("train.seq_len", f"{self.train.seq_len} is longer than the model's "
                                f"positions (model.max_seq_len={self.model.max_seq_len}).",
                                "shorten train.seq_len or raise model.max_seq_len.")
        check_choices(self, "")
        if not self.run_dir:
            raise ScalevecError("run_dir", "is empty.", "set run_dir=<a directory>.")
        unknown = [k for k in self.resume_changes if not _is_option(self, k)]
        if unknown:
            raise ScalevecError("resume_changes", f"names no option: {unknown}.",
                                "name dotted option keys, e.g. "
                                "resume_changes=[optim.lr,optim.weight_decay].")
        if self.branch_from and (self.init_from or self.resume not in ("none", "auto")):
            other = "init_from" if self.init_from else "resume"
            raise ScalevecError("branch_from", f"and {other} both say where the run starts.",
                                f"drop {other} (a branch starts from its trunk's checkpoint; "
                                "resume=auto continues a branch that has checkpoints of its own).")

    def derive(self, world_size: int) -> None:
        """Fill the options derived from others: a null train.micro_batch from the ranks,
        train.steps and checkpoint.every from their tokens per parameter."""
        self.train.derive_micro_batch(world_size)
        tokens_per_step = self.train.global_batch * self.train.seq_len
        per_param = {"steps": self.train.tokens_per_param,
                     "every": self.checkpoint.every_tokens_per_param}
        # validate() names bad ones
        per_param = {k: v for k, v in per_param.items() if v is not None and v > 0}
        if not per_param or tokens_per_step <= 0:
            return
        self.model.validate()  # its shapes give the count
        n = self.model.non_embedding_params()
        if "steps" in per_param:
            self.train.steps = max(1, round(per_param["steps"] * n / tokens_per_step))
        if "every" in per_param:  # rounded down: a budget's checkpoint lies before a branch's decay
            self.checkpoint.every = max(1, int(per_param["every"] * n / tokens_per_step))


# The typed schema, built once (~60 ms a time): OmegaConf.merge copies its first config, so
# to_config and from_record merge onto it without changing it.
_SCHEMA = OmegaConf.structured(Config)
# Hydra's base config (`- scalevec_defaults` in configs/config.yaml): every option at its default.
ConfigStore.instance().store(name="scalevec_defaults", node=OmegaConf.to_container(_SCHEMA))


def batch_tokens(tokens: int, *, _root_: DictConfig) -> int:
    """`${batch_tokens:N}`: a global batch of N tokens in sequences of train.seq_len, so that a
    recipe's batch stays N tokens when the sequence length is changed."""
    seq_len = _root_.train.seq_len
    if seq_len <= 0 or tokens % seq_len:
        raise ScalevecError("train.global_batch", f"{tokens} tokens are not a whole number of "
                            f"sequences of train.seq_len={seq_len}.",
                            "set train.global_batch (in sequences), or a sequence length that "
                            f"divides {tokens}.")
    return tokens // seq_len


OmegaConf.register_new_resolver("batch_tokens", batch_tokens)


def to_config(raw: DictConfig, world_size: int = 1) -> Config:
    """Type-check the composed config against the dataclasses, derive what follows from it, validate
    it."""
    try:
        merged = OmegaConf.merge(_SCHEMA, raw)
        cfg = OmegaConf.to_object(merged)
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise ScalevecError(e.full_key or "config", f"unknown key ({e.msg.splitlines()[0]}).",
                            "check the spelling against the config file that defines "
                            "this group.") from None
    except OmegaConfBaseException as e:
        cause = e.__context__
        while cause is not None and not isinstance(cause, ScalevecError):  # a resolver's own error
            cause = cause.__context__
        if cause is not None:
            raise cause from None
        raise ScalevecError(e.full_key or "config", e.msg.splitlines()[0],
                            "give a value of the type the config file documents.") from None
    cfg.derive(world_size)
    cfg.validate(world_size)
    return cfg


def compose_raw(overrides: list[str]) -> DictConfig:
    """The config Hydra composes from configs/ with command-line style overrides, before typing
    (what to_config turns into a Config for any world size)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def compose_config(overrides: list[str], world_size: int = 1) -> Config:
    """The config Hydra composes from configs/ with command-line style overrides, typed and
    validated: what the training command would run (for tools, scripts and tests that are not Hydra
    apps)."""
    raw = compose_raw(overrides)
    check_overrides(raw, overrides)
    return to_config(raw, world_size)


def check_overrides(raw: DictConfig, overrides: list[str]) -> None:
    """A value the command line gives that the composed config would silently replace is an error:
    an explicit train.steps where train.tokens_per_param (e.g. +experiment=ladder's) sets the
    length."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    per_param = raw.train.get("tokens_per_param")
    if "train.steps" in given and per_param is not None:
        raise ScalevecError("train.steps", f"{raw.train.steps} is given, but "
                            f"train.tokens_per_param={per_param} sets the run's length.",
                            "drop train.steps, or add train.tokens_per_param=null to train for "
                            "train.steps steps.")


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_record(record) -> Config:
    """A config written out before (config.yaml, a checkpoint's train state), typed: options added
    since take their defaults."""
    return OmegaConf.to_object(OmegaConf.merge(_SCHEMA, record))


def read_run_config(run_dir: Path) -> Config:
    """A run's config.yaml as written by the trainer."""
    path = run_dir / "config.yaml"
    try:
        return from_record(OmegaConf.load(path))
    except (OSError, OmegaConfBaseException) as e:
        raise ScalevecError(str(path), f"cannot be read as a run's config ({type(e).__name__}).",
                            "branch from a run directory written by the trainer, or one of its "
                            "checkpoints.") from None


def _is_option(cfg: Config, key: str) -> bool:
    """Whether a dotted key names an option of cfg (a leaf: not a group)."""
    node = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return False
        node = getattr(node, part)
    return not dataclasses.is_dataclass(node)

"""The typed root config: Hydra composes YAML from configs/, this module turns it into dataclasses and
validates it before any expensive work. Each component's options live next to the component.

The dataclasses are the one source of every option's default and documentation. Hydra composes on top
of those defaults (registered as `scalevec_defaults`, untyped, so that every option can be overridden
with `key=value` and this module's checks give the one-line errors); presets set only what differs."""

from dataclasses import dataclass, field
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from scalevec_train.data import DataConfig
from scalevec_train.distributed import DistributedConfig
from scalevec_train.errors import ScalevecError
from scalevec_train.logger import LoggerConfig
from scalevec_train.model import ModelConfig
from scalevec_train.optim import OptimConfig
from scalevec_train.schedules import ScheduleConfig
from scalevec_train.strategies import ScaleConfig

# configs/ at the repository root (the package is installed in editable mode next to it).
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@dataclass
class TrainConfig:
    # optimizer steps
    steps: int = 300
    # sequences per optimizer step, summed over all data-parallel ranks
    global_batch: int = 16
    # sequences per forward pass on one rank; global_batch / (micro_batch * ranks) = accumulation steps
    micro_batch: int = 16
    # tokens per training sequence
    seq_len: int = 128
    # clip the global gradient norm to this; 0 disables clipping
    grad_clip: float = 1.0
    # write metrics every this many steps
    log_every: int = 10
    # validate every this many steps (and at the first and last step); 0: only at the first and last
    eval_every: int = 50
    # validation batches of micro_batch sequences per evaluation, over all ranks (a multiple of the
    # rank count); the same sequences every time and on any world size
    eval_batches: int = 8
    # compute precision: auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    dtype: str = "auto"
    # a step with a non-finite loss or gradient norm is skipped (no parameter changes); after this many
    # in a row the run saves a checkpoint and stops (docs/reliability.md)
    max_bad_steps: int = 5
    # log a loss spike when a step's loss exceeds this times the running average of recent losses;
    # 0 disables the check
    spike_factor: float = 1.5

    def validate(self, world_size: int) -> None:
        for key in ("steps", "global_batch", "micro_batch", "seq_len", "log_every", "eval_batches"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"train.{key}", f"must be positive, got {getattr(self, key)}.",
                                    "use a number above 0.")
        if self.eval_every < 0 or self.grad_clip < 0:
            raise ScalevecError("train.eval_every" if self.eval_every < 0 else "train.grad_clip",
                                "must not be negative.", "use 0 to turn it off.")
        per_step = self.micro_batch * world_size
        if self.global_batch % per_step:
            raise ScalevecError(
                "train.global_batch",
                f"{self.global_batch} sequences are not divisible by micro_batch * ranks = "
                f"{self.micro_batch} * {world_size}.",
                f"use a multiple of {per_step}, or change train.micro_batch.")
        if self.eval_batches % world_size:
            raise ScalevecError("train.eval_batches", f"{self.eval_batches} validation batches cannot be split "
                                f"evenly over {world_size} ranks.", f"use a multiple of {world_size}.")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ScalevecError("train.dtype", f"unknown value {self.dtype!r}.", "use auto, fp32 or bf16.")
        if self.max_bad_steps < 1:
            raise ScalevecError("train.max_bad_steps", f"must be at least 1, got {self.max_bad_steps}.",
                                "allow at least one skipped step, e.g. 5.")
        if self.spike_factor != 0 and not self.spike_factor > 1:
            raise ScalevecError("train.spike_factor", f"{self.spike_factor} would flag ordinary steps as spikes.",
                                "use a factor above 1 (e.g. 1.5), or 0 to turn the check off.")


@dataclass
class CheckpointConfig:
    # save every this many steps (and at the end of the run); 0: only at the end
    every: int = 0
    # keep the newest this many complete checkpoints; older ones are deleted
    keep_last: int = 2
    # write checkpoints in the background while training goes on (torch.distributed.checkpoint.async_save)
    async_save: bool = False

    def validate(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ScalevecError("checkpoint.every" if self.every < 0 else "checkpoint.keep_last",
                                "every must be >= 0 and keep_last >= 1.",
                                "use checkpoint.every=0 to save only at the end, and keep at least one.")


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
    # seeds model init, data order and everything random
    seed: int = 0
    # where metrics.jsonl, config.yaml and checkpoints/ go; the default name says what the run is
    run_dir: str = "runs/${model.name}-${scale.name}-${optim.name}-${schedule.name}-s${seed}"
    # none: start fresh (refuses a run_dir that already holds checkpoints) | auto: continue from the
    # newest complete checkpoint in run_dir if there is one | a checkpoint directory path
    resume: str = "none"
    # a Hugging Face Llama folder (config.json + safetensors) whose weights start a fresh run under any
    # dense model and strategy; empty: random initialization. A resumed run takes its checkpoint instead.
    init_from: str = ""
    # auto (cuda if available) | cpu | cuda
    device: str = "auto"
    # normalization kernels: auto (Triton on CUDA, PyTorch elsewhere) | triton | torch
    kernels: str = "auto"

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
        if self.train.seq_len > self.model.max_seq_len:
            raise ScalevecError("train.seq_len", f"{self.train.seq_len} is longer than the model's "
                                f"positions (model.max_seq_len={self.model.max_seq_len}).",
                                "shorten train.seq_len or raise model.max_seq_len.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ScalevecError("device", f"unknown device {self.device!r}.", "use auto, cpu or cuda.")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ScalevecError("kernels", f"unknown value {self.kernels!r}.", "use auto, triton or torch.")
        if not self.run_dir:
            raise ScalevecError("run_dir", "is empty.", "set run_dir=<a directory>.")


# Hydra's base config (`- scalevec_defaults` in configs/config.yaml): every option at its default.
ConfigStore.instance().store(name="scalevec_defaults", node=OmegaConf.to_container(OmegaConf.structured(Config)))


def to_config(raw: DictConfig, world_size: int = 1) -> Config:
    """Type-check the composed config against the dataclasses, then validate it."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        cfg = OmegaConf.to_object(merged)
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise ScalevecError(e.full_key or "config", f"unknown key ({e.msg.splitlines()[0]}).",
                            "check the spelling against the config file that defines this group.") from None
    except OmegaConfBaseException as e:
        raise ScalevecError(e.full_key or "config", e.msg.splitlines()[0],
                            "give a value of the type the config file documents.") from None
    cfg.validate(world_size)
    return cfg


def compose_config(overrides: list[str], world_size: int = 1) -> Config:
    """The config Hydra composes from configs/ with command-line style overrides, typed and validated:
    what the training command would run (for tools, scripts and tests that are not Hydra apps)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        raw = compose(config_name="config", overrides=list(overrides))
    return to_config(raw, world_size)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))

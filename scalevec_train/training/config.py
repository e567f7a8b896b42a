"""The training loop's options (`train.*`) and the checkpoint options (`checkpoint.*`)."""

from dataclasses import dataclass

from scalevec_train.errors import ScalevecError


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

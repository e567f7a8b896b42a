"""The training loop's options (`train.*`, the weight EMA's `train.ema.*`) and the logger's
(`logger.*`)."""

from dataclasses import dataclass, field
from typing import Literal

from scalevec_train.infra.errors import ScalevecError, check_choices, choice


@dataclass
class EMAConfig:
    # an exponential moving average (EMA) of the weights, kept beside the run
    # (training/callbacks/ema.py): its half-life in training tokens, the weight of the weights of a
    # step halving every this many tokens after it (per step, decay = 0.5 ** (tokens per step /
    # half_life_tokens); in tokens, so that it means the same at any batch size). Evaluated at every
    # evaluation (val_loss_ema, val_bpb_ema), checkpointed with the run;
    # `python -m scalevec_train.average <run> ema=last` writes it as a model. 0: off
    half_life_tokens: float = 0.0

    def validate(self) -> None:
        if self.half_life_tokens < 0:
            raise ScalevecError("train.ema.half_life_tokens",
                                f"must not be negative, got {self.half_life_tokens}.",
                                "use a number of tokens (e.g. a tenth of the run's), or 0 to turn "
                                "the EMA off.")


@dataclass
class TrainConfig:
    # optimizer steps (a model's recipe, configs/recipe/, may set another length)
    steps: int = 300
    # the run's length in tokens per parameter: when set, train.steps = tokens_per_param * N /
    # tokens per step, N the model's non-embedding parameters a token multiplies with (active ones
    # in MoE layers; accounting.non_embedding_params), and a train.steps override is an error; null:
    # train.steps
    tokens_per_param: float | None = None
    # sequences per optimizer step, summed over all data-parallel ranks (a recipe gives it in
    # tokens: ${batch_tokens:N} is N tokens at train.seq_len)
    global_batch: int = 16
    # sequences per forward pass on one rank; global_batch / (micro_batch * ranks) = accumulation
    # steps. null: the largest that divides global_batch / ranks and holds at most
    # max_micro_batch_tokens tokens
    micro_batch: int | None = None
    # the most tokens (micro_batch * seq_len) a derived micro_batch holds; lower it when a forward
    # runs out of memory
    max_micro_batch_tokens: int = 16384
    # tokens per training sequence
    seq_len: int = 128
    # clip the global gradient norm to this; 0 disables clipping
    grad_clip: float = 1.0
    # write metrics every this many steps
    log_every: int = 10
    # validate every this many steps (and at the first and last step); 0: only at the first and last
    eval_every: int = 50
    # validation per evaluation: this many global batches (eval_batches * global_batch sequences,
    # the first of the val split in a fixed order), split over the ranks and run micro_batch at a
    # time: the same sequences every time, for every seed, world size and micro-batch
    eval_batches: int = 8
    # weight of the z-loss z_loss * mean(log Z^2) on the output logits (Z: their partition function;
    # OLMo 2 uses 1e-5), added to the training loss and logged apart as z_loss; 0 disables
    z_loss: float = 0.0
    # compute precision: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16. bf16 is one regime on one
    # process and on many: fp32 master weights, gradient reduction and optimizer states; bf16
    # activations and residual stream (autocast, plus FSDP's bf16 copies of the weights when
    # sharded); fp32 scale sites and fp32 arithmetic inside the fused norms, the router and the loss
    # (docs/concepts/architecture.md, "Precision")
    dtype: str = choice("auto", Literal["auto", "fp32", "bf16"])
    # a step with a non-finite loss or gradient norm is skipped (no parameter changes); after this
    # many in a row the run saves a checkpoint and stops (docs/guides/reliability.md)
    max_bad_steps: int = 5
    # log a loss spike when a step's loss exceeds this times the running average of recent losses;
    # 0 disables the check
    spike_factor: float = 1.5
    # profile these steps (numbered from 1), each on its own: a Chrome trace of the step, and on
    # CUDA a memory snapshot, under run_dir/profile/ (docs/guides/experiments.md, "Traces of chosen
    # steps"); empty: off
    profile_steps: list[int] = field(default_factory=list)
    # record every op's input shapes in those traces (larger files)
    profile_record_shapes: bool = False
    # profile on every rank (a file per rank); false: rank 0 only
    profile_all_ranks: bool = False
    # measure the paper's mechanism every this many steps, a multiple of log_every (diag/* metrics:
    # the residual stream's and each normalization's RMS, the largest attention logit per layer, and
    # per linear map its weight RMS, update-to-weight ratio and column norms with and without its
    # input-side scale; docs/guides/experiments.md, "Diagnostics"); 0: off, and the run is the same
    # as without the option
    diagnostics_every: int = 0
    ema: EMAConfig = field(default_factory=EMAConfig)

    def derive_micro_batch(self, world_size: int) -> None:
        """Fill a null micro_batch: the largest divisor of global_batch / ranks within
        max_micro_batch_tokens (at least one sequence). Left null where the batch itself is invalid:
        validate() says why."""
        if self.micro_batch is not None or min(self.global_batch, self.seq_len,
                                               self.max_micro_batch_tokens) <= 0:
            return
        if self.global_batch % world_size == 0:
            per_rank = self.global_batch // world_size
            fits = max(1, self.max_micro_batch_tokens // self.seq_len)
            self.micro_batch = max(d for d in range(1, min(per_rank, fits) + 1)
                                   if per_rank % d == 0)

    def validate(self, world_size: int) -> None:
        check_choices(self, "train.")
        self.ema.validate()
        for key in ("steps", "global_batch", "seq_len", "log_every", "eval_batches",
                    "max_micro_batch_tokens"):
            if getattr(self, key) <= 0:
                raise ScalevecError(f"train.{key}", f"must be positive, got {getattr(self, key)}.",
                                    "use a number above 0.")
        if self.micro_batch is None:  # derive_micro_batch found no whole share per rank
            raise ScalevecError("train.global_batch",
                                f"{self.global_batch} sequences cannot be split evenly over "
                                f"{world_size} ranks.", f"use a multiple of {world_size}.")
        if self.micro_batch <= 0:
            raise ScalevecError("train.micro_batch", f"must be positive, got {self.micro_batch}.",
                                "use a number above 0, or null to derive it.")
        if self.tokens_per_param is not None and self.tokens_per_param <= 0:
            raise ScalevecError("train.tokens_per_param",
                                f"must be positive, got {self.tokens_per_param}.",
                                "use a number above 0, or null to train for train.steps.")
        if self.z_loss < 0:
            raise ScalevecError("train.z_loss", f"must not be negative, got {self.z_loss}.",
                                "use a small weight (e.g. 1e-5), or 0 to turn it off.")
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
        if any(step < 1 for step in self.profile_steps):
            raise ScalevecError("train.profile_steps",
                                f"{list(self.profile_steps)} holds a step below 1.",
                                "name steps from 1 (the first optimizer step), e.g. [10,11].")
        if self.diagnostics_every < 0 or self.diagnostics_every % self.log_every:
            raise ScalevecError("train.diagnostics_every",
                                f"{self.diagnostics_every} is not 0 or a positive multiple of "
                                f"train.log_every={self.log_every}: diagnostics are measured on "
                                "log steps.",
                                f"use a multiple of {self.log_every} (e.g. {self.log_every}), or 0 "
                                "to turn them off.")
        if self.max_bad_steps < 1:
            raise ScalevecError("train.max_bad_steps",
                                f"must be at least 1, got {self.max_bad_steps}.",
                                "allow at least one skipped step, e.g. 5.")
        if self.spike_factor != 0 and not self.spike_factor > 1:
            raise ScalevecError("train.spike_factor",
                                f"{self.spike_factor} would flag ordinary steps as spikes.",
                                "use a factor above 1 (e.g. 1.5), or 0 to turn the check off.")


@dataclass
class LoggerConfig:
    # console (metrics.jsonl + progress bar) | wandb (the same, plus a wandb run)
    name: str = choice("console", Literal["console", "wandb"])
    # show a progress bar with loss, tokens/s and ETA
    progress_bar: bool = True
    # wandb project
    project: str = "scalevec"
    # wandb entity (team or user); empty: your default
    entity: str = ""
    # wandb group; empty: derived from the config (everything but the seed)
    group: str = ""
    # extra wandb tags, added to those derived from the config
    tags: list[str] = field(default_factory=list)
    # auto (offline when no WANDB_API_KEY is set) | online | offline
    mode: str = choice("auto", Literal["auto", "online", "offline"])

    def validate(self) -> None:
        check_choices(self, "logger.")

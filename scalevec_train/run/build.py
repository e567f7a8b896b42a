"""From a validated config to a run ready to train, in data-flow order: where it starts
(run/start.py), data (data/), model (model/), parallelized (parallel/), optimizer (optim/),
callbacks (training/callbacks/), checkpoint manager (checkpoint/), trainer. Each component builds
itself from its own options.

Inputs are checked before expensive work and nothing is written: the checkpoint to resume from (its
files against their checksums, its model) before data preparation, the data (its shards against
their checksums) and the saved data position before the model is initialized. The run directory is
checked and locked before build (run/run_dir.py).
"""

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from scalevec_kernels import KernelError, check_backend
from scalevec_train.checkpoint.manager import CheckpointManager, ModelState, OptimizerState
from scalevec_train.config import Config
from scalevec_train.costs.accounting import peak_flops, train_flops_per_token
from scalevec_train.data import PreparedData, check_vocab, prepare_data
from scalevec_train.data import sources as shard_checks
from scalevec_train.data.mixture import MixtureData
from scalevec_train.data.shards import MANIFEST
from scalevec_train.data.sources import diagnostic_batch, training_loader, validation_batches
from scalevec_train.data.tokenizer import token_bytes
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import check_faults
from scalevec_train.interop.hf_import import check_init_from, init_from_hf
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.optim.schedules import lr_multiplier
from scalevec_train.parallel.data_parallel import parallelize, uses_bf16
from scalevec_train.parallel.process_group import gather_all, local_rank, rank, world_size
from scalevec_train.run.resume import as_record
from scalevec_train.run.start import find_start
from scalevec_train.tasks.load import load_tasks
from scalevec_train.training.callbacks import (
    Checkpointer,
    Diagnostics,
    EpochMonitor,
    Evaluator,
    Fp8Scales,
    HangWatchdog,
    ModelMetrics,
    ScaleMonitor,
    SigtermStop,
    SpeedMonitor,
    StabilityGuard,
    StepProfiler,
    TaskEvaluator,
    WeightEMA,
)
from scalevec_train.training.callbacks.ema import ema_decay
from scalevec_train.training.callbacks.evaluation import Validation
from scalevec_train.training.trainer import (
    Callback,
    Compute,
    Schedule,
    StepRecipe,
    Trainer,
    checkpointed,
    training_loss,
)


@dataclass
class Run:
    """What build() makes: the trainer (with its callbacks) and what the entry point reports
    from."""

    trainer: Trainer
    data: PreparedData | MixtureData
    run_dir: Path
    checkpointer: Checkpointer
    branched_from: Path | None  # the trunk's checkpoint when this run starts a branch (branch_from)
    attended: float | None = None  # mean keys a query attends under document masking (None: causal)
    # (step, checkpoint, the allowed changes of the config) when this run continues a checkpoint
    continued: tuple[int, Path, dict] | None = None


def build(cfg: Config) -> Run:
    """Everything a run needs but its metrics logger (the entry point makes it once the run's files
    are written, and hands it to Trainer.fit)."""
    device = resolve_device(cfg.device)
    check_backends(cfg, device)
    documents = cfg.model.attention_mask == "document"
    loss_fn = training_loss(cfg.distributed.compile)
    check_faults()
    start = find_start(cfg)
    with torch.device("meta"):  # the model's shapes, to check the start against
        model = Transformer(cfg.model, cfg.scale)
    continued = start.check(cfg, model)
    # A resumed run continues from its own weights; init_from only seeds a fresh one.
    init_weights = (check_init_from(model, cfg.init_from)
                    if cfg.init_from and start.train_state is None else None)

    data = prepare_data(cfg.data)
    check_vocab(data, cfg.model.vocab_size)
    if cfg.data.verify:
        check_shards(data)
    rank_, world = rank(), world_size()
    train_loader = training_loader(data, cfg.train.seq_len, cfg.train.micro_batch, cfg.seed, rank_,
                                   world, documents)
    val_data = validation_batches(data, cfg.train.seq_len, cfg.train.micro_batch,
                                  cfg.train.eval_batches * cfg.train.global_batch, rank_, world,
                                  documents)
    # every rank reads (or generates) all items: which rank scores which follows from the item's
    # index
    tasks = load_tasks(cfg.tasks, cfg.data, data.load_tokenizer(), cfg.model.max_seq_len)
    if start.train_state is not None:
        train_loader.load_state_dict(start.train_state["loader"])

    if cfg.distributed.compile:
        # Graphs compiled for an earlier run in this process (a sweep's jobs under Hydra's basic
        # launcher) fit none of this run's blocks when its maps differ (FP8's matmuls) and count
        # against dynamo's recompile limit, which fullgraph makes an error: the third run met it.
        torch._dynamo.reset()
    model = parallelize(model, cfg.distributed, device, cfg.seed, cfg.train.dtype)
    if init_weights is not None:
        init_from_hf(model, init_weights)
    optimizer = build_optimizer(model, cfg.optim)

    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    attended = train_loader.attended_keys() if documents else None
    callbacks, ema = training_callbacks(cfg, start.run_dir, model, device, data, val_data, tasks,
                                        attended)
    manager = CheckpointManager.from_config(
        cfg.checkpoint, start.run_dir,
        tensors={"model": ModelState(model), "optim": OptimizerState(model, optimizer),
                 **({"ema": ema} if ema else {})},
        records={"loader": train_loader, **checkpointed(callbacks)},
        info={"model_config": cfg.model.architecture(), "optimizer": cfg.optim.name,
              "config": as_record(cfg)},
        optional=frozenset({"ema"}))
    if start.checkpoint is not None:
        manager.load(start.checkpoint, start.train_state)
    checkpointer = Checkpointer(manager, cfg.checkpoint.every)
    callbacks += [checkpointer, HangWatchdog(cfg.distributed, start.run_dir)]

    schedule = Schedule(cfg.train.steps,
                        partial(lr_multiplier, cfg.schedule, total_steps=cfg.train.steps),
                        cfg.train.log_every,
                        start_step=start.train_state["step"] if start.train_state else 0)
    recipe = StepRecipe(accum=cfg.train.global_batch // (cfg.train.micro_batch * world),
                        tokens_per_step=tokens_per_step, grad_clip=cfg.train.grad_clip,
                        loss_fn=loss_fn, z_loss_coef=cfg.train.z_loss, documents=documents)
    trainer = Trainer(model, optimizer, train_loader, schedule, recipe,
                      Compute(device, autocast_for(cfg.train.dtype, device)), callbacks)
    return Run(trainer, data, start.run_dir, checkpointer, start.branched_from, attended,
               (start.train_state["step"], start.checkpoint, continued)
               if start.train_state else None)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ScalevecError("device", "cuda was asked for but no GPU is visible.",
                                "use device=cpu.")
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def autocast_for(dtype: str, device: torch.device):
    """The precision context of a forward: bf16 autocast where train.dtype resolves to bf16."""
    if uses_bf16(dtype, device):
        return partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return nullcontext


def check_backends(cfg: Config, device: torch.device) -> None:
    """Raises unless the model's kernels and attention backend run on `device`."""
    try:
        check_backend(cfg.model.kernels, device.type)
    except KernelError as e:
        raise ScalevecError("model.kernels", e.problem, e.fix) from None
    if (cfg.model.attention_mask == "document" and cfg.model.attention_backend == "flex"
            and device.type != "cuda"):
        raise ScalevecError("model.attention_backend",
                            "flex trains on CUDA only: torch has no FlexAttention backward on CPU.",
                            "use model.attention_backend=auto or sdpa.")


def training_callbacks(cfg: Config, run_dir: Path, model: torch.nn.Module,
                       device: torch.device, data: PreparedData | MixtureData,
                       val_data: list | dict[str, list], tasks: list,
                       attended: float | None) -> tuple[list[Callback], WeightEMA | None]:
    """The callbacks that observe the run (all but the checkpointer, which needs the checkpoint
    manager that saves theirs), and the weight EMA among them when train.ema is on."""
    rank_, world = rank(), world_size()
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    profiles = cfg.train.profile_steps and (rank_ == 0 or cfg.train.profile_all_ranks)
    weights = ({entry.name: entry.weight for entry, _ in data.sources}
               if isinstance(data, MixtureData) else None)
    validation = Validation(val_data, token_bytes(data.load_tokenizer()), weights)
    ema = (WeightEMA(model, ema_decay(cfg.train.ema.half_life_tokens, tokens_per_step), validation,
                     cfg.train.eval_every) if cfg.train.ema.half_life_tokens else None)
    documents = cfg.model.attention_mask == "document"
    callbacks = [
        *([StepProfiler(cfg.train.profile_steps, run_dir / "profile", rank_,
                        cfg.train.profile_record_shapes)]
          if profiles else []),
        StabilityGuard(cfg.train.max_bad_steps, cfg.train.spike_factor),
        SigtermStop(),
        *Fp8Scales.of(model),
        SpeedMonitor(tokens_per_step, train_flops_per_token(model, cfg.train.seq_len, attended),
                     peak_flops(device), world),
        ScaleMonitor(),
        ModelMetrics(),
        *([Diagnostics(cfg.train.diagnostics_every,
                       diagnostic_batch(data, cfg.train.seq_len, cfg.train.micro_batch, documents))]
          if cfg.train.diagnostics_every else []),
        EpochMonitor(cfg.data.max_repeats),
        Evaluator(validation, cfg.train.eval_every),
        *([TaskEvaluator(tasks, cfg.tasks.every, cfg.tasks.batch_size, rank_, world)]
          if tasks else []),
        *([ema] if ema else []),
    ]
    return callbacks, ema


def check_shards(data: PreparedData | MixtureData) -> None:
    """Raises on every rank alike, naming the shard, unless every shard of `data` matches the
    checksum its manifest recorded; each rank reads a share of them. Every rank calls it."""
    problems = [p for found in gather_all(
                    shard_checks.mismatches(shard_checks.shards_of(data)[rank()::world_size()]))
                for p in found]
    if problems:
        where, problem = problems[0]
        raise ScalevecError(where, problem, f"{shard_checks.reprepare(where)}; or, if you trust "
                            "the shards as they are, data.verify=false.")
    if rank() == 0:
        for split_dir in shard_checks.unrecorded(data):
            print(f"note: {split_dir / MANIFEST} records no checksums (prepared before scalevec "
                  "recorded them): its shards are read unverified; prepare the data again to "
                  "record them.", file=sys.stderr)

"""From a validated config to a run ready to train: data, model, optimizer, checkpoint manager, and the
trainer with its callbacks, built in data-flow order.

Inputs are checked before expensive work and nothing is written: the run directory and the checkpoint
to resume from (its files against their checksums, its model) before data preparation, the data (its
shards against their checksums) and the saved data position before the model is initialized.
"""

import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from scalevec_kernels import KernelError, check_backend
from scalevec_train.checkpoint import integrity
from scalevec_train.checkpoint.files import check_model_fits, checkpoint_root, find_resume, inspect
from scalevec_train.checkpoint.manager import CheckpointManager, ModelState, OptimizerState
from scalevec_train.config import Config
from scalevec_train.costs.accounting import peak_flops, train_flops_per_token
from scalevec_train.data import PreparedData, TokenLoader, check_vocab, prepare_data
from scalevec_train.data import sources as shard_checks
from scalevec_train.data.mixture import MixtureData
from scalevec_train.data.mixture_loader import MixtureLoader
from scalevec_train.data.shards import MANIFEST
from scalevec_train.data.tokenizer import token_bytes
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import check_faults
from scalevec_train.interop.hf_import import check_init_from, init_from_hf
from scalevec_train.model.config import architecture_diff
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.optim.schedules import lr_multiplier
from scalevec_train.parallel.data_parallel import parallelize, uses_bf16
from scalevec_train.parallel.process_group import broadcast_object, gather_all, local_rank, rank, world_size
from scalevec_train.run.branch import branch_point, check_own_run_dir
from scalevec_train.run.resume import as_record, check_continuation, saved_config
from scalevec_train.tasks.load import load_tasks
from scalevec_train.training.callbacks import (
    Checkpointer,
    Diagnostics,
    EpochMonitor,
    Evaluator,
    Fp8Scales,
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
from scalevec_train.training.trainer import Compute, Schedule, StepRecipe, Trainer, checkpointed, training_loss


@dataclass
class Run:
    """What build() makes: the trainer (with its callbacks) and what the entry point reports from."""

    trainer: Trainer
    data: PreparedData | MixtureData
    run_dir: Path
    checkpointer: Checkpointer
    branched_from: Path | None  # the trunk's checkpoint when this run starts a branch (branch_from)
    attended: float | None = None  # mean keys a query attends under document masking (None: causal)
    # (step, checkpoint, the allowed changes of the config) when this run continues a checkpoint
    continued: tuple[int, Path, dict] | None = None


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ScalevecError("device", "cuda was asked for but no GPU is visible.", "use device=cpu.")
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def autocast_for(dtype: str, device: torch.device):
    """The precision context of a forward: bf16 autocast where train.dtype resolves to bf16."""
    if uses_bf16(dtype, device):
        return partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return nullcontext


def build(cfg: Config) -> Run:
    """Everything a run needs but its metrics logger (the entry point makes it once the run's files
    are written, and hands it to Trainer.fit)."""
    device = resolve_device(cfg.device)
    try:
        check_backend(cfg.model.kernels, device.type)
    except KernelError as e:
        raise ScalevecError("model.kernels", e.problem, e.fix) from None
    documents = cfg.model.attention_mask == "document"
    if documents and cfg.model.attention_backend == "flex" and device.type != "cuda":
        raise ScalevecError("model.attention_backend", "flex trains on CUDA only: torch has no FlexAttention "
                            "backward on CPU.", "use model.attention_backend=auto or sdpa.")
    loss_fn = training_loss(cfg.distributed.compile)
    check_faults()
    # Every rank uses rank 0's run_dir and checkpoint choice.
    run_dir = Path(broadcast_object(cfg.run_dir))
    check_run_dir(run_dir)
    if cfg.branch_from:
        check_own_run_dir(Path(cfg.branch_from), run_dir)
    resume_from = broadcast_object(find_resume(run_dir, cfg.resume))
    # A branch that has checkpoints of its own continues from them (resume=auto) like any run.
    branched_from = broadcast_object(branch_point(cfg, run_dir)) if cfg.branch_from and not resume_from else None
    resume_from = resume_from or branched_from
    if resume_from and cfg.checkpoint.verify:
        key = "branch_from" if branched_from else "resume"
        integrity.verify(resume_from, lambda good: f"{key}={good}", "checkpoint.verify=false")
    train_state = inspect(resume_from) if resume_from else None
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    if train_state is not None:
        continued = check_continuation_of(cfg, resume_from, train_state, branched_from is not None)
        check_resumable(cfg, resume_from, train_state, model)
    # A resumed run continues from its own weights; init_from only seeds a fresh one.
    init_weights = check_init_from(model, cfg.init_from) if cfg.init_from and train_state is None else None
    data = prepare_data(cfg.data)
    check_vocab(data, cfg.model.vocab_size)
    if cfg.data.verify:
        check_shards(data)

    rank_, world = rank(), world_size()
    if isinstance(data, MixtureData):
        train_loader = MixtureLoader(data, cfg.train.seq_len, cfg.train.micro_batch, cfg.seed, rank_, world,
                                     documents)
    else:
        train_loader = TokenLoader(data, "train", cfg.train.seq_len, cfg.train.micro_batch, cfg.seed, rank_, world,
                                   documents)
    # The validation set is the first eval_batches * global_batch sequences of the val split in a fixed
    # order (seed 0, whatever the run's seed), split over the ranks: the same sequences, and so a
    # comparable val_loss, for every seed, world size and micro-batch. A mixture's sources have one each.
    val_data = validation_batches(cfg, data, rank_, world)
    # every rank reads (or generates) all items: which rank scores which follows from the item's index
    tasks = load_tasks(cfg.tasks, cfg.data, data.load_tokenizer(), cfg.model.max_seq_len)
    if train_state is not None:
        train_loader.load_state_dict(train_state["loader"])

    model = parallelize(model, cfg.distributed, device, cfg.seed, cfg.train.dtype)
    if init_weights is not None:
        init_from_hf(model, init_weights)
    optimizer = build_optimizer(model, cfg.optim)

    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    attended = train_loader.attended_keys() if documents else None
    profiles = cfg.train.profile_steps and (rank_ == 0 or cfg.train.profile_all_ranks)
    weights = {entry.name: entry.weight for entry, _ in data.sources} if isinstance(data, MixtureData) else None
    validation = Validation(val_data, token_bytes(data.load_tokenizer()), weights)
    ema = (WeightEMA(model, ema_decay(cfg.train.ema.half_life_tokens, tokens_per_step), validation,
                     cfg.train.eval_every) if cfg.train.ema.half_life_tokens else None)
    callbacks = [
        *([StepProfiler(cfg.train.profile_steps, run_dir / "profile", rank_, cfg.train.profile_record_shapes)]
          if profiles else []),
        StabilityGuard(cfg.train.max_bad_steps, cfg.train.spike_factor),
        SigtermStop(),
        *Fp8Scales.of(model),
        SpeedMonitor(tokens_per_step, train_flops_per_token(model, cfg.train.seq_len, attended), peak_flops(device),
                     world),
        ScaleMonitor(),
        ModelMetrics(),
        *([Diagnostics(cfg.train.diagnostics_every, diagnostic_batch(cfg, data))]
          if cfg.train.diagnostics_every else []),
        EpochMonitor(cfg.data.max_repeats),
        Evaluator(validation, cfg.train.eval_every),
        *([TaskEvaluator(tasks, cfg.tasks.every, cfg.tasks.batch_size, rank_, world)] if tasks else []),
        *([ema] if ema else []),
    ]
    manager = CheckpointManager(
        run_dir, tensors={"model": ModelState(model), "optim": OptimizerState(model, optimizer),
                          **({"ema": ema} if ema else {})},
        records={"loader": train_loader, **checkpointed(callbacks)},
        info={"model_config": cfg.model.architecture(), "optimizer": cfg.optim.name, "config": as_record(cfg)},
        keep_last=cfg.checkpoint.keep_last, async_save=cfg.checkpoint.async_save, optional=frozenset({"ema"}))
    if resume_from is not None:
        manager.load(resume_from, train_state)
    checkpointer = Checkpointer(manager, cfg.checkpoint.every)
    callbacks.append(checkpointer)
    schedule = Schedule(cfg.train.steps, partial(lr_multiplier, cfg.schedule, total_steps=cfg.train.steps),
                        cfg.train.log_every, start_step=train_state["step"] if train_state else 0)
    recipe = StepRecipe(accum=cfg.train.global_batch // (cfg.train.micro_batch * world),
                        tokens_per_step=tokens_per_step, grad_clip=cfg.train.grad_clip, loss_fn=loss_fn,
                        z_loss_coef=cfg.train.z_loss, documents=documents)
    trainer = Trainer(model, optimizer, train_loader, schedule, recipe,
                      Compute(device, autocast_for(cfg.train.dtype, device)), callbacks)
    return Run(trainer, data, run_dir, checkpointer, branched_from, attended,
               (train_state["step"], resume_from, continued) if train_state else None)


def check_shards(data: PreparedData | MixtureData) -> None:
    """Raises on every rank alike, naming the shard, unless every shard of `data` matches the checksum its
    manifest recorded; each rank reads a share of them. Every rank calls it."""
    problems = [p for found in gather_all(shard_checks.mismatches(shard_checks.shards_of(data)[rank()::world_size()]))
                for p in found]
    if problems:
        where, problem = problems[0]
        raise ScalevecError(where, problem, f"{shard_checks.reprepare(where)}; or, if you trust the shards as "
                            "they are, data.verify=false.")
    if rank() == 0:
        for split_dir in shard_checks.unrecorded(data):
            print(f"note: {split_dir / MANIFEST} records no checksums (prepared before scalevec recorded them): "
                  "its shards are read unverified; prepare the data again to record them.", file=sys.stderr)


def validation_batches(cfg: Config, data: PreparedData | MixtureData, rank_: int,
                       world: int) -> list | dict[str, list]:
    """This rank's share of the validation set (see build); of each source's, by name, for a mixture."""
    if isinstance(data, MixtureData):
        return {entry.name: validation_batches(cfg, prepared, rank_, world) for entry, prepared in data.sources}
    loader = TokenLoader(data, "val", cfg.train.seq_len, cfg.train.micro_batch, 0, rank_, world,
                         cfg.model.attention_mask == "document")
    return [loader.next_batch() for _ in range(cfg.train.eval_batches * cfg.train.global_batch
                                               // (cfg.train.micro_batch * world))]


def diagnostic_batch(cfg: Config, data: PreparedData | MixtureData):
    """The batch the diagnostics measure activations on: the val split's first micro_batch sequences in
    the validation order (a mixture's: its first source's), the same on every rank."""
    if isinstance(data, MixtureData):
        data = data.sources[0][1]
    return TokenLoader(data, "val", cfg.train.seq_len, cfg.train.micro_batch, 0, 0, 1,
                       cfg.model.attention_mask == "document").next_batch()


def check_run_dir(run_dir: Path) -> None:
    """Fails, creating nothing, unless run_dir is or can become a writable folder."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == run_dir else f"would be a folder under the file {existing}"
        raise ScalevecError("run_dir", f"{run_dir} {where}, so it cannot hold a run.",
                            "set run_dir to a folder path (an existing run or a new name).")
    root = checkpoint_root(run_dir)
    for folder in (existing, root) if root.is_dir() else (existing,):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ScalevecError("run_dir", f"{folder} is not writable.",
                                "fix its permissions, or set run_dir to a folder you can write to.")


def check_continuation_of(cfg: Config, path: Path, train_state: dict, branch: bool) -> dict[str, dict]:
    """The config's changes from the run that wrote checkpoint `path` (continuation.py), refused where one
    defines the trajectory; {} when that run's config is unknown (a checkpoint copied alone, written
    before checkpoints held their config), which is said."""
    saved = saved_config(train_state, path)
    if saved is None:
        print(f"note: the config that wrote {path} is unknown (no config.yaml beside it): continuing without "
              "comparing it with this one.", file=sys.stderr)
        return {}
    return check_continuation(saved, cfg, train_state["step"], path, "branch_from" if branch else "resume",
                              length_checked=branch)


def check_resumable(cfg: Config, path: Path, train_state: dict, model: torch.nn.Module) -> None:
    """Raises unless checkpoint `path` was written for this model and optimizer (`model` may be on the
    meta device): before any data is prepared or weight initialized."""
    diff = architecture_diff(train_state["model_config"], cfg.model.architecture())
    if diff:
        raise ScalevecError(str(path), f"was written by another model (differs in {diff}).",
                            "resume with the model config of that run, or use another run_dir.")
    saved_optim = train_state.get("optimizer", cfg.optim.name)  # absent in older checkpoints
    if saved_optim != cfg.optim.name:
        raise ScalevecError(str(path), f"holds the state of optimizer {saved_optim!r}; this run uses "
                            f"optim={cfg.optim.name}.", f"resume with optim={saved_optim}, or use another run_dir.")
    check_model_fits(path, model)

"""Training entry point: `python -m scalevec_train.train [hydra overrides]` (or under torchrun).

config -> data + model + optimizer -> training loop -> metrics and checkpoints.
What survives crashes, signals and bad numbers, and how failures are reported: docs/reliability.md.
"""

import json
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from scalevec_train import checkpointing, distributed
from scalevec_train.config import CONFIG_DIR, Config, to_config, to_yaml
from scalevec_train.data import TokenLoader, check_vocab, prepare_data
from scalevec_train.describe import describe
from scalevec_train.errors import DivergedError, ScalevecError
from scalevec_train.flops import peak_flops, train_flops_per_token
from scalevec_train.guards import StepGuard, StopSignal, fault_nan_steps
from scalevec_train.hf_import import check_init_from, init_from_hf
from scalevec_train.logger import MetricsLogger, wandb_init_args
from scalevec_train.model import Transformer
from scalevec_train.moe import discard_moe_counts, moe_aux_loss, moe_layers, moe_metrics, total_params, update_moe_bias
from scalevec_train.optim import build_optimizer, describe_groups
from scalevec_train.schedules import lr_multiplier
from scalevec_train.strategies import site_grad_norms, site_stats


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ScalevecError("device", "cuda was asked for but no GPU is visible.", "use device=cpu.")
        return torch.device("cuda", distributed.local_rank())
    return torch.device("cpu")


def autocast(cfg: Config, device: torch.device):
    bf16 = distributed.uses_bf16(cfg.train.dtype, device)
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class Trainer:
    """Runs the optimization loop; owns no construction logic (see build())."""

    def __init__(self, cfg: Config, model, optimizer, train_loader, val_data, device, run_dir: Path,
                 start_step: int = 0, nan_steps: frozenset[int] = frozenset()):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.train_loader, self.val_data = train_loader, val_data
        self.device, self.run_dir, self.step = device, run_dir, start_step
        self.moe = moe_layers(model)  # found once: the module tree is final after parallelize()
        self.replicated = distributed.replicated_params(model)
        self.site_grads: dict[str, float] = {}  # of the last step taken with log=True
        world = distributed.world_size()
        self.accum = cfg.train.global_batch // (cfg.train.micro_batch * world)
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.flops_per_token = train_flops_per_token(model, cfg.train.seq_len)
        self.peak = peak_flops(device)
        self.guard = StepGuard(cfg.train.max_bad_steps, cfg.train.spike_factor)
        self.nan_steps = nan_steps  # fault injection (guards.fault_nan_steps)

    def train_step(self, log: bool = False) -> tuple[float, float]:
        """One optimizer step over global_batch sequences; returns (mean loss, grad norm). With `log`,
        the scale sites' gradient norms (before clipping) are kept in self.site_grads for the metrics.

        A step whose loss or gradient norm is not finite changes nothing: its gradients are dropped and
        neither the optimizer nor the MoE bias moves. Its batches still count as used and the step
        counter (and with it the learning-rate schedule) still advances. Every rank reaches the same
        verdict, since the loss is averaged over the ranks and the gradient norm is global."""
        cfg = self.cfg
        scale = lr_multiplier(cfg.schedule, self.step, cfg.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * scale
        total = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in self.train_loader.next_batch())
            distributed.set_gradient_sync(self.model, micro == self.accum - 1)
            with autocast(cfg, self.device):
                loss = cross_entropy(self.model(inputs), targets)
            if self.step + 1 in self.nan_steps:
                loss = loss * float("nan")
            total += loss.detach()
            if self.moe:
                # MoE auxiliary losses train the router but are not the logged loss.
                loss = loss + moe_aux_loss(self.moe)
            (loss / self.accum).backward()
        distributed.reduce_replicated_grads(self.replicated)
        if log:
            self.site_grads = site_grad_norms(self.model)
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        grad_norm = distributed.clip_grad_norm(self.model, clip)
        mean_loss = distributed.all_reduce_mean(total / self.accum).item()
        if StepGuard.finite(mean_loss, grad_norm):
            self.optimizer.step()
            update_moe_bias(self.moe)
        else:
            discard_moe_counts(self.moe)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return mean_loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in self.val_data:
            with autocast(self.cfg, self.device):
                total += cross_entropy(self.model(inputs.to(self.device)), targets.to(self.device))
        self.model.train()
        return distributed.all_reduce_mean(total / len(self.val_data)).item()

    def save(self) -> Path:
        return checkpointing.save(self.run_dir, self.step, self.model, self.optimizer,
                                  {"loader": self.train_loader.state_dict(), "model_config": asdict(self.cfg.model),
                                   "optimizer": self.cfg.optim.name, "guard": self.guard.state_dict()},
                                  self.cfg.checkpoint.keep_last, self.cfg.checkpoint.async_save)

    def fit(self, logger: MetricsLogger) -> None:
        """Train to cfg.train.steps. Stops early with a checkpoint at the current step on SIGTERM
        (returns) and after train.max_bad_steps non-finite steps in a row (raises DivergedError)."""
        cfg = self.cfg
        steps, every = cfg.train.steps, cfg.train.eval_every
        if self.step == 0:
            logger.log({"step": 0, "tokens": 0, "val_loss": self.evaluate()})
        window_start, window_steps = time.perf_counter(), 0
        with StopSignal() as sigterm:
            while self.step < steps:
                loss, grad_norm = self.train_step(log=(self.step + 1) % cfg.train.log_every == 0
                                                  or self.step + 1 == steps)
                verdict = self.guard.observe(loss, grad_norm)
                window_steps += 1
                logger.advance()
                last = self.step == steps
                # Every rank stops at the same step, also when the signal reached only some of them.
                stop = "SIGTERM" if distributed.any_rank(sigterm.received, self.device) else None
                if self.guard.diverged:
                    stop = "diverged"
                record = {}
                if verdict or stop or self.step % cfg.train.log_every == 0 or last:
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = window_steps * self.tokens_per_step / elapsed
                    record = {"step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"],
                              "grad_norm": grad_norm, "tokens": self.step * self.tokens_per_step,
                              "tokens_per_s": tokens_per_s,
                              "tokens_per_s_per_device": tokens_per_s / distributed.world_size(),
                              "skipped_steps": self.guard.skipped}
                    if self.peak:
                        record["mfu"] = tokens_per_s * self.flops_per_token / (self.peak * distributed.world_size())
                    record.update(site_stats(self.model))
                    record.update(self.site_grads)
                    self.site_grads = {}
                    if distributed.is_main():  # only rank 0 writes records
                        record.update(moe_metrics(self.moe))
                    if "bad_step" in verdict:
                        del record["loss"], record["grad_norm"]
                    record.update(verdict)
                    self._warn(verdict, loss, grad_norm)
                    window_start, window_steps = time.perf_counter(), 0
                if last or (every and self.step % every == 0):
                    record.update({"step": self.step, "tokens": self.step * self.tokens_per_step,
                                   "val_loss": self.evaluate()})
                if stop:
                    record["stopped"] = stop
                if record:
                    logger.log(record)
                saving = last or stop or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0)
                if saving:
                    path = self.save()
                if stop:
                    checkpointing.finish()
                    self._stopped(stop, path)
                    return
                if saving or "val_loss" in record:
                    # Evaluation and checkpoint time does not count against the next throughput window.
                    window_start, window_steps = time.perf_counter(), 0

    def _warn(self, verdict: dict, loss: float, grad_norm: float) -> None:
        if not verdict or not distributed.is_main():
            return
        if "bad_step" in verdict:
            message = (f"step {self.step} skipped: loss {loss}, gradient norm {grad_norm} ({self.guard.streak} in "
                       f"a row; the run stops at train.max_bad_steps={self.cfg.train.max_bad_steps}).")
        else:
            message = (f"loss spike at step {self.step}: {loss:.4g} is more than train.spike_factor="
                       f"{self.cfg.train.spike_factor} times the running average {verdict['loss_ema']:.4g}.")
        print(f"warning: {message}", file=sys.stderr)

    def _stopped(self, reason: str, path: Path) -> None:
        """Report an early stop whose checkpoint `path` is complete."""
        if reason == "diverged":
            good = self.step - self.guard.streak
            raise DivergedError(
                f"training (steps {good + 1}-{self.step})",
                f"{self.guard.streak} steps in a row had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={self.cfg.train.max_bad_steps}). Checkpoint {path} holds the parameters "
                f"and optimizer state of step {good}, the last good one, and the data position after step "
                f"{self.step}.",
                "lower optim.lr, lengthen schedule.warmup_steps or set train.grad_clip, then continue with "
                "resume=auto; or look at the data of those steps.")
        if distributed.is_main():
            print(f"stopped by SIGTERM after step {self.step}: checkpoint {path} is complete. Continue with "
                  "resume=auto.", file=sys.stderr)


def build(cfg: Config):
    """Everything a run needs, built in data-flow order. Inputs are checked before expensive work and
    nothing is written: the run directory and the checkpoint to resume from (its files, its model)
    before data preparation, the data and the saved data position before the model is initialized."""
    device = resolve_device(cfg.device)
    nan_steps = fault_nan_steps()
    # Every rank uses rank 0's run_dir and checkpoint choice.
    run_dir = Path(distributed.broadcast_object(cfg.run_dir))
    check_run_dir(run_dir)
    resume_from = distributed.broadcast_object(checkpointing.find_resume(run_dir, cfg.resume))
    train_state = checkpointing.inspect(resume_from) if resume_from else None
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    if train_state is not None:
        check_resumable(cfg, resume_from, train_state, model)
    # A resumed run continues from its own weights; init_from only seeds a fresh one.
    init_weights = check_init_from(model, cfg.init_from) if cfg.init_from and train_state is None else None
    data = prepare_data(cfg.data)
    check_vocab(data, cfg.model.vocab_size)

    rank, world = distributed.rank(), distributed.world_size()
    train_loader = TokenLoader(data, "train", cfg.train.seq_len, cfg.train.micro_batch, cfg.seed, rank, world)
    # The validation set is the first eval_batches * micro_batch sequences of the val split in a fixed
    # order (seed 0, whatever the run's seed), split over the ranks: the same sequences, and so a
    # comparable val_loss, for every seed and world size.
    val_loader = TokenLoader(data, "val", cfg.train.seq_len, cfg.train.micro_batch, 0, rank, world)
    val_data = [val_loader.next_batch() for _ in range(cfg.train.eval_batches // world)]
    if train_state is not None:
        train_loader.load_state_dict(train_state["loader"])

    model = distributed.parallelize(model, cfg.distributed, device, cfg.seed, cfg.train.dtype)
    if init_weights is not None:
        init_from_hf(model, init_weights)
    model.set_kernels(cfg.kernels)
    optimizer = build_optimizer(model, cfg.optim, cfg.scale)
    trainer = Trainer(cfg, model, optimizer, train_loader, val_data, device, run_dir,
                      train_state["step"] if train_state else 0, nan_steps)
    if resume_from is not None:
        checkpointing.load(resume_from, model, optimizer, train_state["world_size"])
        if "guard" in train_state:
            trainer.guard.load_state_dict(train_state["guard"])
    return trainer, data


def check_run_dir(run_dir: Path) -> None:
    """Fails, creating nothing, unless run_dir is or can become a writable folder."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == run_dir else f"would be a folder under the file {existing}"
        raise ScalevecError("run_dir", f"{run_dir} {where}, so it cannot hold a run.",
                            "set run_dir to a folder path (an existing run or a new name).")
    root = checkpointing.checkpoint_root(run_dir)
    for folder in (existing, root) if root.is_dir() else (existing,):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ScalevecError("run_dir", f"{folder} is not writable.",
                                "fix its permissions, or set run_dir to a folder you can write to.")


def check_resumable(cfg: Config, path: Path, train_state: dict, model: torch.nn.Module) -> None:
    """Raises unless checkpoint `path` was written for this model and optimizer (`model` may be on the
    meta device): before any data is prepared or weight initialized."""
    saved, current = train_state["model_config"], asdict(cfg.model)
    if saved != current:
        diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        raise ScalevecError(str(path), f"was written by another model (differs in {diff}).",
                            "resume with the model config of that run, or use another run_dir.")
    saved_optim = train_state.get("optimizer", cfg.optim.name)  # absent in older checkpoints
    if saved_optim != cfg.optim.name:
        raise ScalevecError(str(path), f"holds the state of optimizer {saved_optim!r}; this run uses "
                            f"optim={cfg.optim.name}.", f"resume with optim={saved_optim}, or use another run_dir.")
    checkpointing.check_model_fits(path, model)


def write_run_files(cfg: Config, run_dir: Path, tokenizer_path: Path) -> None:
    """The resolved config, the model description and the tokenizer: a run directory is self-contained."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "describe.json").write_text(json.dumps(describe(cfg), indent=1))
    shutil.copyfile(tokenizer_path, run_dir / "tokenizer.model")


def drop_partial_line(path: Path) -> None:
    """Cut off an unfinished last line of a file of JSON lines. A process killed while appending a record
    leaves one (a long record takes several writes); the resumed run logs that step again."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        end = pos = f.seek(0, os.SEEK_END)
        keep = 0
        while pos > 0:
            start = max(0, pos - (1 << 16))
            f.seek(start)
            cut = f.read(pos - start).rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            pos = start
        if keep < end:
            f.truncate(keep)


def run(cfg: Config) -> Path:
    """Train to cfg.train.steps (or until SIGTERM, see Trainer.fit); returns the run directory."""
    trainer, data = build(cfg)
    run_dir = trainer.run_dir
    main = distributed.is_main()
    wandb_init = None
    if main:
        write_run_files(cfg, run_dir, data.tokenizer_path)
        drop_partial_line(run_dir / "metrics.jsonl")
        print(f"run_dir: {run_dir}  params: {total_params(trainer.model):,}  "
              f"optimizer: {describe_groups(trainer.optimizer)}", file=sys.stderr)
        if cfg.logger.name == "wandb":
            wandb_init = wandb_init_args(cfg.logger, OmegaConf.to_container(OmegaConf.structured(cfg)), run_dir)
    logger = MetricsLogger(cfg.logger, run_dir, cfg.train.steps, trainer.step, wandb_init, enabled=main)
    try:
        trainer.fit(logger)
        checkpointing.finish()
    finally:
        logger.close()
    return run_dir


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def main(raw: DictConfig) -> None:
    """Exit codes: 0 done, or stopped by SIGTERM with a checkpoint; 1 a bug (with its traceback) or a
    Hydra error; 2 bad input (one line naming the key or file and the fix); 3 diverged (see fit())."""
    try:
        # Checked before joining the process group: a bad config fails at once, on every rank.
        cfg = to_config(raw, distributed.world_size())
        distributed.init()
        run(cfg)
    except ScalevecError as e:
        rank = f"[rank {os.environ.get('RANK', 0)}] " if distributed.world_size() > 1 else ""
        print(f"{rank}error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()

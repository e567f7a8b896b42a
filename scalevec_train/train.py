"""Training entry point: `python -m scalevec_train.train [hydra overrides]` (or under torchrun).

config -> data + model + optimizer -> training loop -> metrics and checkpoints.
"""

import json
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
from scalevec_train.errors import ScalevecError
from scalevec_train.flops import peak_flops, train_flops_per_token
from scalevec_train.logger import MetricsLogger, wandb_init_args
from scalevec_train.model import Transformer
from scalevec_train.moe import moe_aux_loss, moe_metrics, update_moe_bias
from scalevec_train.optim import build_optimizer, describe_groups
from scalevec_train.schedules import lr_multiplier
from scalevec_train.strategies import site_stats


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
                 start_step: int):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.train_loader, self.val_data = train_loader, val_data
        self.device, self.run_dir, self.step = device, run_dir, start_step
        world = distributed.world_size()
        self.accum = cfg.train.global_batch // (cfg.train.micro_batch * world)
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.flops_per_token = train_flops_per_token(model, cfg.train.seq_len)
        self.peak = peak_flops(device)

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over global_batch sequences; returns (mean loss, grad norm)."""
        cfg = self.cfg
        scale = lr_multiplier(cfg.schedule, self.step, cfg.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.optim.lr * scale
        total = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in self.train_loader.next_batch())
            distributed.set_gradient_sync(self.model, micro == self.accum - 1)
            with autocast(cfg, self.device):
                loss = cross_entropy(self.model(inputs), targets)
            # MoE auxiliary losses (zero for dense models) train the router but are not the logged loss.
            ((loss + moe_aux_loss(self.model)) / self.accum).backward()
            total += loss.detach()
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        update_moe_bias(self.model)
        self.step += 1
        mean_loss = distributed.all_reduce_mean(total / self.accum)
        return mean_loss.item(), distributed.full_value(grad_norm).item()

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in self.val_data:
            with autocast(self.cfg, self.device):
                total += cross_entropy(self.model(inputs.to(self.device)), targets.to(self.device))
        self.model.train()
        return distributed.all_reduce_mean(total / len(self.val_data)).item()

    def save(self) -> None:
        checkpointing.save(self.run_dir, self.step, self.model, self.optimizer,
                           {"loader": self.train_loader.state_dict(),
                            "model_config": asdict(self.cfg.model)},
                           self.cfg.checkpoint.keep_last, self.cfg.checkpoint.async_save)

    def fit(self, logger: MetricsLogger) -> None:
        cfg = self.cfg
        steps, every = cfg.train.steps, cfg.train.eval_every
        if self.step == 0:
            logger.log({"step": 0, "tokens": 0, "val_loss": self.evaluate()})
        window_start, window_steps = time.perf_counter(), 0
        while self.step < steps:
            loss, grad_norm = self.train_step()
            window_steps += 1
            logger.advance()
            last = self.step == steps
            record = {}
            if self.step % cfg.train.log_every == 0 or last:
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_steps * self.tokens_per_step / elapsed
                record = {"step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"],
                          "grad_norm": grad_norm, "tokens": self.step * self.tokens_per_step,
                          "tokens_per_s": tokens_per_s,
                          "tokens_per_s_per_device": tokens_per_s / distributed.world_size()}
                if self.peak:
                    record["mfu"] = tokens_per_s * self.flops_per_token / (self.peak * distributed.world_size())
                record.update(site_stats(self.model))
                record.update(moe_metrics(self.model))
                window_start, window_steps = time.perf_counter(), 0
            if last or (every and self.step % every == 0):
                record.update({"step": self.step, "tokens": self.step * self.tokens_per_step,
                               "val_loss": self.evaluate()})
            if record:
                logger.log(record)
            saving = last or (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0)
            if saving:
                self.save()
            if saving or "val_loss" in record:
                # Evaluation and checkpoint time does not count against the next throughput window.
                window_start, window_steps = time.perf_counter(), 0


def build(cfg: Config):
    """Everything a run needs, built in data-flow order; validates inputs before expensive work."""
    device = resolve_device(cfg.device)
    # Every rank uses rank 0's run_dir and checkpoint choice.
    run_dir = Path(distributed.broadcast_object(cfg.run_dir))
    resume_from = distributed.broadcast_object(checkpointing.find_resume(run_dir, cfg.resume))
    train_state = checkpointing.read_train_state(resume_from) if resume_from else None
    if train_state is not None:
        saved = train_state["model_config"]
        current = asdict(cfg.model)
        if saved != current:
            diff = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
            raise ScalevecError(str(resume_from), f"was written by another model (differs in {diff}).",
                                "resume with the model config of that run, or use another run_dir.")
    data = prepare_data(cfg.data)
    check_vocab(data, cfg.model.vocab_size)

    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.scale)
    model = distributed.parallelize(model, cfg.distributed, device, cfg.seed, cfg.train.dtype)
    model.set_kernels(cfg.kernels)
    optimizer = build_optimizer(model, cfg.optim, cfg.scale)

    rank, world = distributed.rank(), distributed.world_size()
    train_loader = TokenLoader(data, "train", cfg.train.seq_len, cfg.train.micro_batch, cfg.seed, rank, world)
    # The validation set is the first eval_batches * micro_batch sequences of the val split, split
    # over the ranks: the same sequences (and so the same val_loss) on any world size.
    val_loader = TokenLoader(data, "val", cfg.train.seq_len, cfg.train.micro_batch, cfg.seed, rank, world)
    val_data = [val_loader.next_batch() for _ in range(cfg.train.eval_batches // world)]
    start_step = 0
    if resume_from is not None:
        checkpointing.load(resume_from, model, optimizer)
        train_loader.load_state_dict(train_state["loader"])
        start_step = train_state["step"]
    return Trainer(cfg, model, optimizer, train_loader, val_data, device, run_dir, start_step), data


def write_run_files(cfg: Config, run_dir: Path, tokenizer_path: Path) -> None:
    """The resolved config, the model description and the tokenizer: a run directory is self-contained."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "describe.json").write_text(json.dumps(describe(cfg), indent=1))
    shutil.copyfile(tokenizer_path, run_dir / "tokenizer.model")


def run(cfg: Config) -> Path:
    """Train to cfg.train.steps; returns the run directory."""
    trainer, data = build(cfg)
    run_dir = trainer.run_dir
    main = distributed.is_main()
    wandb_init = None
    if main:
        write_run_files(cfg, run_dir, data.tokenizer_path)
        print(f"run_dir: {run_dir}  params: {sum(p.numel() for p in trainer.model.parameters()):,}  "
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
    try:
        distributed.init()
        run(to_config(raw, distributed.world_size()))
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()

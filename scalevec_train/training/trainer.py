"""The training loop: it takes optimizer steps and calls its callbacks' hooks; everything that
observes the run (throughput, scale statistics, evaluation, checkpoints, the numerical guard,
SIGTERM) is a callback (callbacks/).

One step: for each micro-batch, forward (plus the model's auxiliary loss), backward; gradients
synced and clipped; the optimizer steps unless the loss or gradient norm is not finite. A step that
is not taken changes nothing (its gradients are dropped, the model forgets its step state), but its
batches count as used and the step counter (and with it the learning-rate schedule) advances. Every
rank reaches the same verdict: the loss is averaged over the ranks and the gradient norm is global.

Under document masking some targets are not counted (data/loader.py) and the micro-batches and ranks
count different numbers of them: each micro-batch's mean loss is then weighted by its count over the
step's global count, so that the step's loss and gradient are the mean over every counted target of
the global batch, whatever the accumulation and world size (as torchtitan and OLMo-core normalize).
Causal runs count every target and keep the plain mean over micro-batches.

The host never waits for the device within a step: the loss, the gradient norm and the verdict stay
on the device (skip.py applies the step where the verdict says so), and the host reads them only on
the steps that read back: log steps, and steps a callback asked to read back (a checkpoint).
"""

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from scalevec_train.data.loader import IGNORE, Loader
from scalevec_train.infra import progress
from scalevec_train.infra.faults import fault_point, loss_fault
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import (
    clip_grad_norm,
    reduce_replicated_grads,
    replicated_params,
    set_gradient_sync,
)
from scalevec_train.parallel.process_group import all_reduce_mean, all_reduce_sum, world_size
from scalevec_train.training.logger import MetricsLogger
from scalevec_train.training.skip import ConditionalStep


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the counted targets (those not IGNORE)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def z_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean(log Z^2) over the counted targets' positions, Z = sum(exp(logits)) (OLMo 2, PaLM): pulls
    the log-partition towards 0, and with it the logits' magnitude that the final norm's scale
    sets."""
    counted = targets != IGNORE
    log_z = logits.float().logsumexp(-1)
    return (log_z.square() * counted).sum() / counted.sum()


def micro_weights(batches: list, device: torch.device) -> torch.Tensor:
    """Each micro-batch's share of the step's counted targets, times the world size (the ranks'
    gradients are averaged), on the device: sum over ranks and micro-batches of weight * mean loss =
    the mean over all counted targets. Counted on the host from the loader's tensors: no read of the
    device."""
    counts = torch.stack([(b.targets != IGNORE).sum() for b in batches]).to(device, torch.float64)
    return (counts * world_size() / all_reduce_sum(counts.sum())).float()


def training_loss(compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """cross_entropy, or compiled as one graph (distributed.compile): fused, the fp32 logits,
    softmax and its gradient take fewer passes (about 2x faster on a CPU at dense-study's shape,
    docs/benchmarks/cpu.md)."""
    return torch.compile(cross_entropy, fullgraph=True) if compiled else cross_entropy


@dataclass(frozen=True)
class StepResult:
    """One step's outcome, on the device (0-dim tensors: read them only on steps that read back)."""

    loss: torch.Tensor  # mean over the step's micro-batches and the ranks
    grad_norm: torch.Tensor  # global, before clipping
    taken: torch.Tensor  # bool; False: not finite, so nothing changed
    # wall time of the step; the steps since the last read-back add up to the device's
    seconds: float
    # z_loss_coef * mean log Z^2, the part of the training loss not in `loss`
    z_loss: torch.Tensor | None = None


class Callback:
    """Observes the loop. Every hook does nothing unless a subclass overrides it. A callback puts
    metrics in the logs with trainer.record(); one that holds state to resume is Stateful
    (state_dict, load_state_dict) and names its entry of the checkpoint's train_state.json in
    `checkpoint_key`.

    Every hook runs on the callbacks in one order (ordered()): by `priority`, lower first; callbacks
    of equal priority in the order they were given (build.py's list)."""

    checkpoint_key: str | None = None
    priority: int = 0

    def on_fit_start(self, trainer: "Trainer") -> None:
        """Before the first step (also of a resumed run)."""

    def on_step_start(self, trainer: "Trainer") -> None:
        """Before a step's first forward; may call trainer.request_read_back() for the coming
        step."""

    def on_backward_end(self, trainer: "Trainer") -> None:
        """The step's gradients are complete (synced over ranks, not yet clipped)."""

    def on_step_end(self, trainer: "Trainer", result: StepResult) -> None:
        """After the step. May call trainer.request_log() or trainer.request_stop(); reads `result`
        on the host only when trainer.reads_back."""

    def on_log(self, trainer: "Trainer") -> None:
        """A logged step: record() what its record should show."""

    def on_step_done(self, trainer: "Trainer") -> None:
        """After the step's record is written."""

    def on_fit_end(self, trainer: "Trainer") -> None:
        """After the last step, or the step a stop was requested at; not after an exception."""

    def on_close(self, trainer: "Trainer") -> None:
        """Always, last: release what on_fit_start took."""


def ordered(callbacks: list[Callback]) -> list[Callback]:
    """`callbacks` in the order their hooks run: by priority, lower first, ties as given (a stable
    sort)."""
    return sorted(callbacks, key=lambda cb: cb.priority)


def checkpointed(callbacks: list[Callback]) -> dict[str, Stateful]:
    """The callbacks whose state a checkpoint keeps, by their train_state.json key."""
    return {cb.checkpoint_key: cb for cb in callbacks if cb.checkpoint_key is not None}


@dataclass(frozen=True)
class Schedule:
    """Which steps the trainer takes and logs, and the learning rate of each."""

    steps: int  # train to this step
    lr_at: Callable[[int], float]  # the schedule's multiplier of each group's `base_lr` at a step
    log_every: int
    start_step: int = 0  # the steps taken before (a resumed run)


@dataclass(frozen=True)
class StepRecipe:
    """What one optimizer step computes."""

    accum: int  # micro-batches per step on each rank
    tokens_per_step: int  # of the global batch
    grad_clip: float  # the global gradient norm clipped to; 0: no clipping
    # the training loss, a mean over the counted targets
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    z_loss_coef: float = 0.0  # the weight of z_loss() in the training loss
    # the loader's batches have document ids (model.attention_mask=document)
    documents: bool = False


@dataclass(frozen=True)
class Compute:
    """Where the model runs, and the precision context of a forward."""

    device: torch.device
    autocast: Callable[[], AbstractContextManager]


class Trainer:
    """Trains `model` with `optimizer` on `loader`'s batches over `schedule`'s steps (or to an
    earlier requested stop), each step as `recipe` says, observed by `callbacks` (run in their
    priority order)."""

    def __init__(self, model: Transformer, optimizer: torch.optim.Optimizer, loader: Loader,
                 schedule: Schedule, recipe: StepRecipe, compute: Compute,
                 callbacks: list[Callback]):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.schedule, self.recipe, self.compute = schedule, recipe, compute
        self.callbacks = ordered(callbacks)
        self.step = schedule.start_step
        self.logger: MetricsLogger | None = None  # set by fit()
        self.replicated = replicated_params(model)
        self.optimizer_step = ConditionalStep(optimizer, model)
        self.stop_reason: str | None = None
        self._stop_error: Exception | None = None
        self._log_requested = self._read_back_requested = False
        self._records: dict[int, dict] = {}  # step -> metrics recorded for it, not yet written

    def add_callbacks(self, *callbacks: Callback) -> None:
        """Add callbacks to a built trainer (a test's counters, a benchmark's clocks), each in its
        place."""
        self.callbacks = ordered([*self.callbacks, *callbacks])

    def is_log_step(self, step: int) -> bool:
        """Whether step number `step` (1-based: the step in progress is self.step + 1) logs
        regularly."""
        return step % self.schedule.log_every == 0 or step == self.schedule.steps

    @property
    def reads_back(self) -> bool:
        """Whether the step just taken (self.step) may read device values on the host: a log step,
        or a step a callback asked for (request_read_back)."""
        return self.is_log_step(self.step) or self._read_back_requested

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def record(self, name: str, value: float | torch.Tensor, step: int | None = None) -> None:
        """Put metric `name` in the record of `step` (default: the current one), written at the end
        of this step. `value` may be a 0-dim device tensor: all of a write's tensors are read in one
        transfer. A step with recorded metrics writes a record even if it does not log; a callback
        that records on such a step asks for its read-back first (request_read_back in
        on_step_start), so that the records of earlier steps the guard judges then are written
        before it, in step order."""
        self._records.setdefault(self.step if step is None else step, {})[name] = value

    def request_log(self) -> None:
        self._log_requested = True

    def request_read_back(self) -> None:
        self._read_back_requested = True

    def request_stop(self, reason: str, error: Exception | None = None) -> None:
        """Stop after the current step (with a checkpoint); fit() then raises `error` if given."""
        if self.stop_reason is None:
            self.stop_reason, self._stop_error = reason, error

    def train_step(self) -> StepResult:
        """One optimizer step over the global batch."""
        start = time.perf_counter()
        recipe, device = self.recipe, self.compute.device
        multiplier = self.schedule.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * multiplier
        total = torch.zeros((), device=device)
        z_total = torch.zeros((), device=device) if recipe.z_loss_coef else None
        batches = [self.loader.next_batch() for _ in range(recipe.accum)]
        progress.current.mark("forward/backward", self.step + 1)
        # the mean over micro-batches (1 / accum each), or each one's share of the counted targets
        weights = micro_weights(batches, device) if recipe.documents else None
        for micro, batch in enumerate(batches):
            inputs, targets = (t.to(device, non_blocking=True) for t in batch[:2])
            doc_ids = None if batch.doc_ids is None else batch.doc_ids.to(device, non_blocking=True)
            set_gradient_sync(self.model, micro == recipe.accum - 1)
            with self.compute.autocast():
                logits = self.model(inputs, doc_ids=doc_ids)
                loss = loss_fault(recipe.loss_fn(logits, targets), self.step + 1)
                if z_total is not None:  # trains the logits' scale; logged apart from the loss
                    z = recipe.z_loss_coef * z_loss(logits, targets)
            del logits  # not kept alive through the next micro-batch's forward
            total += loss.detach() if weights is None else loss.detach() * weights[micro]
            if z_total is not None:
                z_total += z.detach() if weights is None else z.detach() * weights[micro]
                loss = loss + z
            aux = self.model.auxiliary_loss()
            if aux is not None:  # trains the router; not part of the logged loss
                loss = loss + aux
            if weights is None:
                (loss / recipe.accum).backward()
            else:  # the router's loss too is weighted by the micro-batch's share of tokens
                (loss * weights[micro]).backward()
        reduce_replicated_grads(self.replicated)
        for cb in self.callbacks:
            cb.on_backward_end(self)
        progress.current.mark("optimizer", self.step + 1)
        fault_point("step.optimizer", self.step + 1)
        grad_norm = clip_grad_norm(self.model,
                                   recipe.grad_clip if recipe.grad_clip > 0 else float("inf"))
        mean_loss = all_reduce_mean(total / recipe.accum if weights is None else total)
        z_mean = (None if z_total is None
                  else all_reduce_mean(z_total / recipe.accum if weights is None else z_total))
        taken = torch.isfinite(mean_loss) & torch.isfinite(grad_norm)
        self.optimizer_step(taken)
        self.model.discard_step_state()
        self.optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda" and (self.is_log_step(self.step + 1) or self._read_back_requested):
            # the host reads back after this step anyway: the wait for the device belongs to its
            # time
            torch.cuda.synchronize(device)
        return StepResult(mean_loss, grad_norm, taken, time.perf_counter() - start, z_mean)

    def fit(self, logger: MetricsLogger) -> str | None:
        """Train to the schedule's last step, writing records to `logger`; returns the reason of an
        early stop (None when the run is complete), or raises the error a callback stopped the run
        with."""
        self.logger = logger
        progress.current.reset(self.step)
        try:
            for cb in self.callbacks:
                cb.on_fit_start(self)
            self._write()
            while self.step < self.schedule.steps and self.stop_reason is None:
                self._one_step()
            for cb in self.callbacks:
                cb.on_fit_end(self)
        finally:
            for cb in self.callbacks:
                cb.on_close(self)
        if self._stop_error is not None:
            raise self._stop_error
        return self.stop_reason

    def _one_step(self) -> None:
        self._log_requested = self._read_back_requested = False
        progress.current.mark("data", self.step + 1)
        for cb in self.callbacks:
            cb.on_step_start(self)
        fault_point("step.start", self.step + 1)
        result = self.train_step()
        self.step += 1
        progress.current.mark("record", self.step)
        for cb in self.callbacks:
            cb.on_step_end(self, result)
        self.logger.advance()
        if self.is_log_step(self.step) or self._log_requested or self.stop_reason:
            loss, grad_norm = torch.stack([result.loss, result.grad_norm]).tolist()
            self.record("lr", self.lr)
            if math.isfinite(loss) and math.isfinite(grad_norm):  # NaN and Infinity are not JSON
                self.record("loss", loss)
                self.record("grad_norm", grad_norm)
            if result.z_loss is not None:
                self.record("z_loss", result.z_loss)
            for cb in self.callbacks:
                cb.on_log(self)
        if self.stop_reason:
            self.record("stopped", self.stop_reason)
        fault_point("step.record", self.step)
        self._write()
        fault_point("step.checkpoint", self.step)
        for cb in self.callbacks:
            cb.on_step_done(self)

    def _write(self) -> None:
        """Write the recorded metrics, one record per step in step order, reading their device
        values in one transfer."""
        if not self._records:
            return
        records = [(step, self._records[step]) for step in sorted(self._records)]
        self._records = {}
        tensors = [v for _, r in records for v in r.values() if isinstance(v, torch.Tensor)]
        values = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()
                      if tensors else [])
        for step, recorded in records:
            metrics = {k: next(values) if isinstance(v, torch.Tensor) else v
                       for k, v in recorded.items()}
            self.logger.log({"step": step, "tokens": step * self.recipe.tokens_per_step, **metrics})

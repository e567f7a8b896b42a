"""An exponential moving average (EMA) of the weights, kept beside the run
(train.ema.half_life_tokens): a cheap stand-in for a learning-rate cooldown (a WSD branch),
evaluated as the run goes and written as a model by
`python -m scalevec_train.average <run> ema=last`.

After every optimizer step each floating-point tensor of the model's state (every parameter, sharded
ones and the fp32 replicated scale sites alike, and the MoE routers' expert_bias, which goes with
the router weights as in checkpoint averaging) moves towards the new weights:

    ema_n = ema_(n-1) + w_n * (weights_n - ema_(n-1)),   w_n = (1 - d) / (1 - d^n),

n the optimizer steps taken so far, d the decay per step. The debiased w_n (as Adam's moments are
debiased) makes ema_n the mean of the weights after steps 1..n with weights proportional to d^(n-i):
no trace of the initial weights, however long the half-life. A skipped step (non-finite) changed no
weight and moves nothing here either: the trainer's verdict selects w_n = 0 on the device, with no
host read.

The EMA is fp32 and laid out like the parameters (DTensor shards on each rank under FSDP2, whole
tensors for the replicated sites), so it costs one fp32 copy of each rank's share of the parameters
(and an evaluation of it one more copy of the weights, for the time of the evaluation). It is a
tensor state of the run's checkpoints (`ema.weights.<name>`, `ema.count`), so that it resumes
exactly and reshards to another world size with the model; a checkpoint written without it starts
the EMA afresh from the resumed weights.
"""

import sys

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import reshard
from scalevec_train.parallel.process_group import is_main, local
from scalevec_train.training.callbacks.evaluation import Periodic, Validation
from scalevec_train.training.trainer import StepResult, Trainer


def ema_decay(half_life_tokens: float, tokens_per_step: int) -> float:
    """The decay per step of an EMA whose weights halve every `half_life_tokens` tokens."""
    return 0.5 ** (tokens_per_step / half_life_tokens)


class WeightEMA(Periodic, Stateful):
    """Keeps the EMA of `model`'s weights with decay `decay` per step (see the module docstring)
    and, at the steps Periodic says (train.eval_every, as the Evaluator), records the metrics of
    `validation` of the EMA weights: val_loss_ema (and val_bpb_ema; for a data mixture also each
    source's val_loss_ema/<name>), swapped into the model for the evaluation and back (the training
    state is left as it was, bit for bit). Stateful through the checkpoint's tensors (DCP), not
    train_state.json: build.py adds it there."""

    def __init__(self, model: Transformer, decay: float, validation: Validation, every: int):
        self.decay, self.validation, self.every = decay, validation, every
        # the model's own tensors, by their checkpoint names (in-place updates show through)
        self.live = {name: t for name, t in get_model_state_dict(model).items()
                     if t.is_floating_point()}
        self.weights = {name: torch.empty_like(t, dtype=torch.float32)
                        for name, t in self.live.items()}
        device = next(iter(self.live.values())).device
        # steps taken, on the device
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        self.loaded = False

    def state_dict(self) -> dict:
        return {"count": self.count, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        # DCP loads into the tensors state_dict() handed it; copied only where it handed back others
        if state["count"] is not self.count:
            self.count.copy_(state["count"])
        for name, t in state["weights"].items():
            if t is not self.weights[name]:
                self.weights[name].copy_(t)
        self.loaded = True

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(EMA, model tensor) as local tensors (a DTensor's local view is a new object every
        time)."""
        return [(local(self.weights[name]), local(t)) for name, t in self.live.items()]

    @torch.no_grad()
    def on_fit_start(self, trainer: Trainer) -> None:
        if not self.loaded:
            if trainer.step and is_main():
                print(f"ema: the checkpoint of step {trainer.step} holds no EMA of the weights; it "
                      "starts here, from the resumed weights.", file=sys.stderr)
            for ema, live in self._pairs():
                ema.copy_(live)
            self.count.zero_()
        super().on_fit_start(trainer)

    @torch.no_grad()
    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        taken = result.taken
        self.count += taken
        weight = torch.where(taken, (1 - self.decay) / (1 - self.decay ** self.count.clamp(min=1)),
                             0.0)
        weight = weight.float()
        for ema, live in self._pairs():
            ema.lerp_(live.to(ema.dtype), weight)
        super().on_step_end(trainer, result)

    @torch.no_grad()
    def record(self, trainer: Trainer) -> None:
        pairs = self._pairs()
        kept = [live.clone() for _, live in pairs]
        reshard(trainer.model)  # the root's gathered weights are the live ones: gather the EMA's
        for ema, live in pairs:
            live.copy_(ema)
        try:
            self.validation.record(trainer, "_ema")
        finally:
            for (_, live), before in zip(pairs, kept, strict=True):
                live.copy_(before)
            reshard(trainer.model)

"""The paper's mechanism, and the maps' outliers and FP8's error, measured every
train.diagnostics_every steps (training/probes.py says what and how)."""

import torch

from scalevec_train.data.loader import Batch
from scalevec_train.training.probes import (
    activation_stats,
    fp8_grad_snr,
    map_input_stats,
    map_stats,
    site_stats,
    sites_before,
    weights_before,
)
from scalevec_train.training.trainer import Callback, Trainer


class Diagnostics(Callback):
    """On every `every`-th step (a log step: train.diagnostics_every is a multiple of log_every, so
    the host reads nothing more often): the maps' weight and the sites' scale statistics after the
    step, their update over it, and the activation statistics of one forward of `batch`, the same
    sequences every time. Copies of the weights and sites are taken only for a diagnostic step,
    after its backward; a step the optimizer skips shows an update of 0, since skipping leaves the
    weights as they were."""

    # after ModelMetrics (0): its forward replaces the step's MoE losses, which ModelMetrics reports
    priority = 1

    def __init__(self, every: int, batch: Batch):
        self.every, self.batch = every, batch
        # the maps' weights and the sites' vectors before a diagnostic step
        self.before: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def _due(self, step: int) -> bool:
        return step % self.every == 0

    def on_backward_end(self, trainer: Trainer) -> None:
        if self._due(trainer.step + 1):
            self.before = weights_before(trainer.model), sites_before(trainer.model)

    def on_log(self, trainer: Trainer) -> None:
        if not self._due(trainer.step):
            return
        tokens = self.batch.inputs.to(trainer.compute.device)
        doc_ids = (None if self.batch.doc_ids is None
                   else self.batch.doc_ids.to(trainer.compute.device))
        maps, sites = self.before or (None, None)
        autocast = trainer.compute.autocast
        values = {**map_stats(trainer.model, maps), **site_stats(trainer.model, sites),
                  **activation_stats(trainer.model, tokens, doc_ids, autocast),
                  **map_input_stats(trainer.model, tokens, doc_ids, autocast),
                  **fp8_grad_snr(trainer.model, tokens, self.batch.targets.to(tokens.device),
                                 doc_ids, autocast)}
        self.before = None
        for key, value in values.items():
            trainer.record(key, value)

"""The scale sites' statistics (docs/concepts/scale-vectors.md, "What is logged"): every log step,
mean, std, min and max of each site's s (and of its magnitude beta under or/er) and the norm of its
parameters' gradient, per layer and over layers by site name."""

import torch
from torch import nn

from scalevec_train.model.strategies import scale_sites, site_display_name
from scalevec_train.parallel.process_group import full_value
from scalevec_train.training.trainer import Callback, Trainer


class ScaleMonitor(Callback):
    """Adds site_stats() to every logged record, and site_grad_norms() of that step to those of the
    regular log steps (gradients exist only between backward and the optimizer's zero_grad)."""

    def __init__(self):
        self.grads: dict[str, float] = {}

    def on_backward_end(self, trainer: Trainer) -> None:
        if trainer.is_log_step(trainer.step + 1):
            self.grads = site_grad_norms(trainer.model)

    def on_log(self, trainer: Trainer) -> None:
        for name, value in {**site_stats(trainer.model), **self.grads}.items():
            trainer.record(name, value)
        self.grads = {}


def site_prefix(path: str, magnitude: bool = False) -> str:
    """The metric prefix of the site at module path `path` (of its magnitude, beta or b, when
    `magnitude`); a statistic follows it: `scale/L<i>/<name>/<stat>` in layer i,
    `scale/<name>/<stat>` for a site outside the layers and for a name's aggregate over the
    layers."""
    layer, name = site_display_name(path)
    name += ".beta" if magnitude else ""
    return f"scale/{name}" if layer is None else f"scale/L{layer}/{name}"


@torch.no_grad()
def site_stats(model: nn.Module) -> dict[str, float]:
    """Mean, std, min and max of every learnable site's s (and beta for or/er), per layer and
    aggregated over layers by site name: keys `scale/<name>/<stat>` and
    `scale/L<i>/<name>/<stat>`."""
    per_name: dict[str, list[torch.Tensor]] = {}
    # Collected on the device and read back in one transfer: one host sync per log step, not per
    # value.
    keys: list[str] = []
    values: list[torch.Tensor] = []

    def add(key: str, v: torch.Tensor) -> None:
        v = v.detach().float().flatten()
        std = v.std() if v.numel() > 1 else torch.zeros((), device=v.device)
        keys.extend(f"{key}/{stat}" for stat in ("mean", "std", "min", "max"))
        values.append(torch.stack([v.mean(), std, v.min(), v.max()]))

    for path, site in scale_sites(model):
        s = site()
        if s is None:
            continue
        layer, name = site_display_name(path)
        tensors = {False: full_value(s)}
        if site.param != "plain":
            tensors[True] = full_value(site.magnitude())
        for magnitude, value in tensors.items():
            per_name.setdefault(site_prefix(name, magnitude), []).append(value.flatten())
            if layer is not None:
                add(site_prefix(path, magnitude), value)
    for key, parts in per_name.items():
        add(key, torch.cat(parts))
    if not values:
        return {}
    return dict(zip(keys, torch.cat(values).tolist()))


@torch.no_grad()
def site_grad_norms(model: nn.Module) -> dict[str, float]:
    """The gradient norm of every learnable site's parameters (and, for or/er, of its magnitude beta
    or b alone), per layer and over layers by site name: `scale/L<i>/<name>/grad_norm`,
    `scale/<name>/grad_norm`, `scale/<name>.beta/grad_norm`. Call between backward and zero_grad; a
    magnitude cancelled by a normalization shows a gradient norm of (almost) 0."""
    squares: dict[str, list[torch.Tensor]] = {}
    for path, site in scale_sites(model):
        if site.param == "fixed":
            continue
        layer, name = site_display_name(path)
        grads = {n: full_value(p.grad).float().square().sum() for n, p in site.named_parameters()
                 if p.grad is not None}
        if not grads:
            continue
        parts = {False: torch.stack(list(grads.values())).sum()}
        if site.param != "plain":
            magnitude = grads.get("beta", grads.get("b"))
            parts[True] = magnitude if magnitude is not None else parts[False].new_zeros(())
        for magnitude, sq in parts.items():
            squares.setdefault(f"{site_prefix(name, magnitude)}/grad_norm", []).append(sq)
            if layer is not None:
                squares[f"{site_prefix(path, magnitude)}/grad_norm"] = [sq]
    if not squares:
        return {}
    norms = torch.stack([torch.stack(v).sum() for v in squares.values()]).sqrt()
    return dict(zip(squares, norms.tolist()))

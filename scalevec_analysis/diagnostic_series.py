"""The diagnostics' series (train.diagnostics_every, diag/* metrics:
scalevec_train/training/probes.py defines them): per layer, or per kind of linear map with its mean
over the layers, against tokens, for plots.plot_diagnostics."""

import re
from dataclasses import dataclass

import numpy as np

from scalevec_analysis.runs import Run
from scalevec_train.infra.errors import ScalevecError

_LAYER = re.compile(r"diag/layer(\d+)")
_LAYER_MAP = re.compile(r"diag/layer\d+/(.+)")


@dataclass(frozen=True)
class Panel:
    """One statistic of the diag/* metrics: `stat` ends the keys; `per`: a line per layer (`layer`,
    with the final stream where it has one), per kind of map, averaged over the layers (`map`), or
    the run's own metric `stat` (`run`: the training loss, beside which the diagnostics read)."""

    stat: str
    title: str
    per: str
    logy: bool = False


PANELS = (
    Panel("loss", "training loss", "run"),
    Panel("resid_rms", "residual stream RMS (entering each block; final)", "layer", logy=True),
    Panel("attn/max_logit", "largest attention logit", "layer"),
    Panel("update_ratio", "update / weight (Frobenius) per step", "map", logy=True),
    Panel("col_gain", "column-norm gain of the input-side scale: RMS|W diag(g)|_j / RMS|W|_j",
          "map"),
    Panel("eff_col_cv", "column-norm spread std/mean of W diag(g)", "map"),
    Panel("col_cv", "column-norm spread std/mean of W", "map"),
    Panel("in_kurtosis", "kurtosis of each map's input", "map", logy=True),
    Panel("in_max_rms", "max / RMS of each map's input", "map", logy=True),
    Panel("fp8_underflow", "share of each map's input its FP8 cast flushes to 0 (model.fp8)",
          "map"),
    Panel("fp8_grad_snr_db", "SNR of each map's FP8 weight gradient against bf16's, dB (model.fp8)",
          "map"),
)


def panel_series(run: Run, panel: Panel) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{line label: (tokens, values)}: `layer <i>` (and `final`), the map's name (`attn.wq`, `head`)
    or the run's metric, at the logged steps that hold the statistic."""
    if panel.per == "run":
        logged = [(r["tokens"], r[panel.stat]) for r in run.records if panel.stat in r]
        return ({panel.stat: (np.array([t for t, _ in logged]), np.array([v for _, v in logged]))}
                if logged else {})
    points: dict[str, dict[float, list[float]]] = {}
    suffix = "/" + panel.stat
    for record in run.records:
        for key, value in record.items():
            if not key.endswith(suffix):
                continue
            inner = key[:-len(suffix)]
            if panel.per == "layer":
                match = _LAYER.fullmatch(inner)
                label = (f"layer {match.group(1)}" if match else "final" if inner == "diag/final"
                         else None)
            else:
                match = _LAYER_MAP.fullmatch(inner)
                label = match.group(1) if match else inner.removeprefix("diag/")
            if label is not None:
                points.setdefault(label, {}).setdefault(record["tokens"], []).append(value)
    return {label: (np.array(sorted(by_tokens)),
                    np.array([np.mean(by_tokens[t]) for t in sorted(by_tokens)]))
            for label, by_tokens in sorted(points.items(), key=lambda item: _order(item[0]))}


def _order(label: str) -> tuple:
    return (0, int(label.split()[1])) if label.startswith("layer ") else (1, label)


def check_diagnostics(runs: list[Run]) -> None:
    for run in runs:
        if not any(k.startswith("diag/") for r in run.records for k in r):
            raise ScalevecError(run.name, "has no diag/* metrics.",
                                "train it with train.diagnostics_every=N (a multiple of "
                                "train.log_every).")

"""Groups of runs that differ only in the seed and bookkeeping: their labels, curves, terminal
losses and token efficiencies against a reference group (see the package docstring), as markdown and
CSV tables."""

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scalevec_analysis.runs import Run
from scalevec_train.infra.errors import ScalevecError

# Config keys that never tell groups apart: they differ per seed or only say where things are kept.
# A branch (branch_from) is its trunk's computation up to the branch point: it groups by its
# own settings.
_IGNORED_KEYS = frozenset({"run_dir", "resume", "data.cache_dir", "branch_from"})
# train.profile_*, train.diagnostics_every: traces and diagnostics change no number of the run;
# tasks.*: downstream tasks only observe it; train.ema.*: nor does the weight EMA kept beside it
# (its own curve is a run of its own, runs.ema_run)
_IGNORED_PREFIXES = ("logger.", "checkpoint.", "hydra.", "train.profile_",
                     "train.diagnostics_every", "tasks.", "train.ema.")
_PATH_SUFFIXES = ("dir", "path", "file")
_STARTING_POINT_KEYS = frozenset({"init_from"})
# Keys tried first when labelling groups, shown under their section name (`scale=unified`).
_LABEL_KEYS = ("scale.name", "optim.name", "model.name", "schedule.name", "data.name")
_UNSET = "(unset)"
# the downstream task metrics (task/<name>/<metric>) the tables show, where runs logged them
TASK_METRICS = ("acc", "acc_norm", "bpb", "chance")
_TASK_MARKDOWN = ("acc", "acc_norm")
_NOT_REACHED = "not reached"


@dataclass
class Group:
    """Runs that differ only in the seed and bookkeeping."""

    label: str
    config: dict[str, Any]  # the config keys that define the group (ignored keys left out)
    runs: list[Run]


@dataclass
class GroupSummary:
    label: str
    runs: int
    tokens: float  # T_G: mean over runs of the tokens at their terminal point
    terminal: float  # mean terminal loss over runs
    std: float  # sample std (ddof=1) of the terminal loss over runs; NaN for one run
    delta: float  # terminal - the reference's terminal (negative: lower loss than the reference)
    reference_tokens: float | None  # T_R; None: the reference never reaches this group's loss
    efficiency: float | None  # T_R / T_G; None: not reached
    is_reference: bool
    # task/<name>/<metric> -> mean over runs of its last logged value, for the keys every run logged
    tasks: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- grouping


def is_ignored(key: str, value: Any, extra: Sequence[str] = ()) -> bool:
    """True for config keys that differ per seed or are bookkeeping: `seed` (and any `*.seed`),
    `run_dir`, `resume`, `data.cache_dir`, `branch_from`, `logger.*`, `checkpoint.*`, `hydra.*`,
    `train.profile_*`, `tasks.*`, `train.ema.*`, path-like
    keys (last part `dir`/`path`/`file` or ending in `_dir`/`_path`/`_file`), keys whose value is an
    absolute or home path (except `init_from`), and the keys (or sections) in `extra`."""
    last = key.rsplit(".", 1)[-1]
    if key in _IGNORED_KEYS or last == "seed" or key.startswith(_IGNORED_PREFIXES):
        return True
    if any(last == s or last.endswith("_" + s) for s in _PATH_SUFFIXES):
        return True
    # the checkpoint a run starts from changes the experiment, wherever it is kept
    if isinstance(value, str) and value.startswith(("/", "~")) and key not in _STARTING_POINT_KEYS:
        return True
    return in_sections(key, extra)


def in_sections(key: str, sections: Sequence[str]) -> bool:
    """True for a key that is one of `sections` or lies under one of them."""
    return any(key == s or key.startswith(s + ".") for s in sections)


def comparable_config(run: Run, ignore: Sequence[str] = ()) -> dict[str, Any]:
    return {k: v for k, v in run.config.items() if not is_ignored(k, v, ignore)}


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _short(key: str) -> str:
    return key[: -len(".name")] if key.endswith(".name") else key


def differing_keys(configs: Sequence[dict[str, Any]]) -> list[str]:
    """The keys, sorted, on which the configs do not all agree (a missing key differs from
    any value)."""
    return [k for k in sorted(set().union(*configs))
            if len({c.get(k, _UNSET) for c in configs}) > 1]


def config_labels(configs: list[dict[str, Any]]) -> list[str]:
    """Short distinct labels: the fewest keys, tried in a readable order, that tell the
    configs apart."""
    differing = differing_keys(configs)
    ordered = ([k for k in _LABEL_KEYS if k in differing]
               + [k for k in differing if k not in _LABEL_KEYS])
    chosen: list[str] = []
    distinct = 1
    for key in ordered:
        n = len({tuple(c.get(k, _UNSET) for k in [*chosen, key]) for c in configs})
        if n > distinct:
            chosen.append(key)
            distinct = n
        if distinct == len(configs):
            break
    if not chosen:
        return [f"scale={_fmt(c['scale.name'])}" if "scale.name" in c else "all runs"
                for c in configs]
    return [" ".join(f"{_short(k)}={_fmt(c.get(k, _UNSET))}" for k in chosen) for c in configs]


def group_runs(runs: Sequence[Run], ignore: Sequence[str] = ()) -> list[Group]:
    """Group runs whose configs agree on every key that `is_ignored` does not drop; in order of
    first appearance. Labels: the fewest differing keys that tell the groups
    apart (`config_labels`)."""
    grouped: dict[tuple, tuple[dict, list[Run]]] = {}
    for run in runs:
        config = comparable_config(run, ignore)
        grouped.setdefault(tuple(sorted(config.items())), (config, []))[1].append(run)
    configs = [c for c, _ in grouped.values()]
    return [Group(label, config, members)
            for label, (config, members) in zip(config_labels(configs), grouped.values(),
                                                strict=True)]


def _matches(value: Any, text: str) -> bool:
    if _fmt(value) == text:
        return True
    try:
        return float(value) == float(text)
    except (TypeError, ValueError):
        return False


def find_group(groups: Sequence[Group], spec: str) -> Group:
    """The one group whose label is `spec`, or that matches every `key=value` in it
    (space-separated; `scale` stands for `scale.name`)."""
    exact = [g for g in groups if g.label == spec]
    if exact:
        return exact[0]
    labels = "; ".join(g.label for g in groups)
    conditions = []
    for term in spec.split():
        key, sep, value = term.partition("=")
        if not sep:
            raise ScalevecError("--reference", f"{spec!r} is neither a group label nor "
                                "key=value terms.", f"use one of: {labels}.")
        if (not any(key in g.config for g in groups)
            and any(key + ".name" in g.config for g in groups)):
            key += ".name"
        conditions.append((key, value))
    hits = [g for g in groups if all(_matches(g.config.get(k, _UNSET), v) for k, v in conditions)]
    if len(hits) != 1:
        which = "no group" if not hits else f"{len(hits)} groups"
        raise ScalevecError("--reference", f"{spec!r} matches {which}.", f"groups are: {labels}.")
    return hits[0]


# --------------------------------------------------------------------------------------- statistics


def metric_curve(run: Run, metric: str, last_k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, values) of a run's metric curve; for `loss`, each value is the trailing mean of the
    last `last_k` logged losses (see the package docstring)."""
    points = [r for r in run.records if metric in r]
    if not points:
        fix = "use --metric loss, or evaluate during training." if metric.startswith("val_") else ""
        raise ScalevecError(run.name, f"no `{metric}` values logged.", fix)
    if any("tokens" not in r for r in points):
        raise ScalevecError(run.name, f"a record with `{metric}` has no `tokens`.",
                            "log cumulative training tokens with every record.")
    tokens = np.array([r["tokens"] for r in points], dtype=np.float64)
    values = np.array([r[metric] for r in points], dtype=np.float64)
    if np.any(np.diff(tokens) <= 0):
        raise ScalevecError(run.name, "`tokens` does not increase with `step`.",
                            "log cumulative training tokens.")
    if metric == "loss" and last_k > 1:
        sums = np.concatenate([[0.0], np.cumsum(values)])
        end = np.arange(1, len(values) + 1)
        start = np.maximum(0, end - last_k)
        values = (sums[end] - sums[start]) / (end - start)
    return tokens, values


def mean_curve(curves: Sequence[tuple[np.ndarray, np.ndarray]],
               where: str = "runs") -> tuple[np.ndarray, np.ndarray]:
    """Mean of curves, each linear between its points, at the union of their token points within the
    range all cover; exact for piecewise-linear curves."""
    lo = max(t[0] for t, _ in curves)
    hi = min(t[-1] for t, _ in curves)
    grid = np.unique(np.concatenate([t for t, _ in curves]))
    grid = grid[(grid >= lo) & (grid <= hi)]
    if grid.size == 0:
        raise ScalevecError(where, "the token ranges of these runs do not overlap.",
                            "compare runs with overlapping token ranges.")
    return grid, np.mean([np.interp(grid, t, v) for t, v in curves], axis=0)


def first_reach(tokens: np.ndarray, values: np.ndarray, target: float) -> float | None:
    """The first token count at which the piecewise-linear curve gets to `target` or below."""
    hits = np.flatnonzero(values <= target)
    if hits.size == 0:
        return None
    i = hits[0]
    if i == 0:
        return float(tokens[0])
    t0, t1, v0, v1 = tokens[i - 1], tokens[i], values[i - 1], values[i]
    return float(t0 + (v0 - target) / (v0 - v1) * (t1 - t0))


def summarize(groups: Sequence[Group], reference: Group, metric: str = "val_loss",
              last_k: int = 1) -> list[GroupSummary]:
    """Terminal loss per group, difference to `reference` and token efficiency
    (package docstring)."""
    curves = {id(g): [metric_curve(r, metric, last_k) for r in g.runs] for g in groups}
    ref_tokens, ref_values = mean_curve(curves[id(reference)], f"group {reference.label!r}")
    ref_terminal = float(np.mean([v[-1] for _, v in curves[id(reference)]]))
    rows = []
    for g in groups:
        finals = np.array([v[-1] for _, v in curves[id(g)]])
        terminal = float(finals.mean())
        tokens = float(np.mean([t[-1] for t, _ in curves[id(g)]]))
        reached = first_reach(ref_tokens, ref_values, terminal)
        rows.append(GroupSummary(
            label=g.label, runs=len(g.runs), tokens=tokens, terminal=terminal,
            std=float(finals.std(ddof=1)) if len(finals) > 1 else math.nan,
            delta=terminal - ref_terminal, reference_tokens=reached,
            efficiency=None if reached is None else reached / tokens, is_reference=g is reference,
            tasks=task_finals(g.runs)))
    return rows


def task_finals(runs: Sequence[Run]) -> dict[str, float]:
    """Each downstream task metric's last logged value (task/<name>/<metric>, metric in
    TASK_METRICS), averaged over `runs`; only keys every run logged."""
    finals = []
    for run in runs:
        last = {}
        for record in run.records:
            last.update({k: v for k, v in record.items()
                         if k.startswith("task/") and k.endswith(TASK_METRICS)})
        finals.append(last)
    keys = sorted(set.intersection(*(set(f) for f in finals))) if finals else []
    return {k: float(np.mean([f[k] for f in finals])) for k in keys}


def ema(values: np.ndarray, beta: float) -> np.ndarray:
    """Exponential moving average s_i = beta * s_(i-1) + (1 - beta) * v_i, starting at s_0 = v_0."""
    out = np.empty(len(values), dtype=np.float64)
    acc = float(values[0])
    for i, v in enumerate(values):
        acc = beta * acc + (1.0 - beta) * float(v)
        out[i] = acc
    return out


# ------------------------------------------------------------------------------------------- tables


def _num(x: float | None, spec: str) -> str:
    if x is None:
        return _NOT_REACHED
    return "n/a" if math.isnan(x) else format(x, spec)


def _task_keys(rows: Sequence[GroupSummary], metrics: Sequence[str]) -> list[str]:
    """The task metric keys any row holds, task by task, in the order of `metrics`."""
    keys = {k for r in rows for k in r.tasks}
    tasks = sorted({k.split("/")[1] for k in keys})
    return [f"task/{t}/{m}" for t in tasks for m in metrics if f"task/{t}/{m}" in keys]


def summary_markdown(rows: Sequence[GroupSummary], metric: str) -> str:
    """One row per group; where runs scored downstream tasks, their final accuracies too (the header
    says each task's chance level)."""
    tasks = _task_keys(rows, _TASK_MARKDOWN)
    chance = {k: next((r.tasks[c] for r in rows
                       if (c := k.rsplit("/", 1)[0] + "/chance") in r.tasks), None)
              for k in tasks}
    task_head = "".join(f" {k.split('/')[1]} {k.split('/')[2]}"
                        + (f" (chance {chance[k]:.3g})" if chance[k] is not None else "") + " |"
                        for k in tasks)
    head = (f"| group | runs | tokens | terminal {metric} | std | Δ vs ref | ref tokens to reach "
            f"| token efficiency |{task_head}\n"
            f"|---|---|---|---|---|---|---|---|{'---|' * len(tasks)}\n")
    body = "".join(
        f"| {r.label}{' (ref)' if r.is_reference else ''} | {r.runs} | {r.tokens:.4g} | "
        f"{r.terminal:.4f} | {_num(r.std, '.4f')} | {r.delta:+.4f} | "
        f"{_num(r.reference_tokens, '.4g')} | {_num(r.efficiency, '.3f')} |"
        + "".join(f" {_num(r.tasks.get(k, math.nan), '.3f')} |" for k in tasks)
        + "\n" for r in rows)
    return head + body


def write_summary_csv(rows: Sequence[GroupSummary], path: Path) -> None:
    """Full-precision numbers; `not reached` spelled out; std empty for a single run; a column per
    downstream task metric (task/<name>/<metric>) where runs logged them (empty for a
    group without)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        tasks = _task_keys(rows, TASK_METRICS)
        w.writerow(["group", "is_reference", "runs", "tokens", "terminal_mean", "terminal_std",
                    "delta_vs_reference", "reference_tokens", "token_efficiency", *tasks])
        for r in rows:
            w.writerow([r.label, r.is_reference, r.runs, repr(r.tokens), repr(r.terminal),
                        "" if math.isnan(r.std) else repr(r.std), repr(r.delta),
                        _NOT_REACHED if r.reference_tokens is None else repr(r.reference_tokens),
                        _NOT_REACHED if r.efficiency is None else repr(r.efficiency),
                        *(repr(r.tasks[k]) if k in r.tasks else "" for k in tasks)])

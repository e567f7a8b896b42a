"""Compare training runs: load them, group them by config minus the seed, measure the differences.

Definitions (the CLI's --help repeats them):

- A run's *metric curve* is (tokens, value) at each logged step that has the metric. For `val_loss`
  the value is the logged validation loss. For `loss` (training loss, which is noisy) the value at a
  point is the mean of the last `last_k` logged losses up to and including it (fewer at the start).
- A run's *terminal loss* is the last point of its metric curve: the final validation loss, or the
  mean of the last `last_k` logged training losses. The run's *tokens* are the tokens at that point.
- A *group* is the runs whose configs agree on every key except the seed and bookkeeping (see
  `is_ignored`). Its terminal loss is the mean over its runs, with their sample standard deviation
  (ddof=1; NaN for a single run). Its tokens T_G are the mean of its runs' tokens.
- A group's *curve* is the mean over its runs of their metric curves, each interpolated linearly in
  tokens at the union of their token points, within the token range that all of them cover.
- The *token efficiency* of group G against the reference group R is T_R / T_G, where T_R is the first
  token count at which R's curve reaches G's terminal loss (value <= it), interpolated linearly in
  tokens between the two logged points around the crossing (T_R is R's first token count if its first
  point is already low enough). >1 means G reaches its loss with fewer tokens than R needs for it.
  When R's curve never gets that low, T_R and the efficiency are "not reached" (None).

Metrics files: a resumed run appends records that repeat steps it had logged before it restarted from
an earlier checkpoint. A step lower than one already seen marks such a restart, and every record at or
after that step from before the restart is dropped. Records with the same step (a validation record
logged on its own line after the training record) are merged, later values winning.

Scaling fit: L(N) = E + A * N^(-alpha), fitted per strategy (series) to the mean terminal loss over the
runs at each parameter count N; see `fit_power_law`.
"""

import csv
import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from scalevec_train.errors import ScalevecError

# Config keys that never tell groups apart: they differ per seed or only say where things are kept.
_IGNORED_KEYS = frozenset({"run_dir", "resume", "data.cache_dir"})
_IGNORED_PREFIXES = ("logger.", "checkpoint.", "hydra.")
_PATH_SUFFIXES = ("dir", "path", "file")
_STARTING_POINT_KEYS = frozenset({"init_from"})
# Keys tried first when labelling groups, shown under their section name (`scale=unified`).
_LABEL_KEYS = ("scale.name", "optim.name", "model.name", "schedule.name", "data.name")
_UNSET = "(unset)"
_NOT_REACHED = "not reached"


@dataclass
class Run:
    """One training run: its flattened config and its metrics, one merged record per step."""

    name: str
    config: dict[str, Any]
    records: list[dict[str, float]]
    params: float | None = None  # parameter count N, needed only by the scaling fit


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


@dataclass
class PowerLawFit:
    """L(N) = E + A * N^(-alpha)."""

    E: float
    A: float
    alpha: float
    rmse: float  # root mean square residual over the fitted points

    def __call__(self, n):
        return self.E + self.A * np.power(np.asarray(n, dtype=np.float64), -self.alpha)


@dataclass
class ScalingSeries:
    """One strategy's points: mean terminal loss at each parameter count."""

    label: str
    sizes: np.ndarray  # distinct parameter counts N, ascending
    losses: np.ndarray  # mean terminal loss over the runs at each N
    counts: np.ndarray  # number of runs at each N
    fit: PowerLawFit | None  # None with fewer than 3 sizes


# ---------------------------------------------------------------------------------------------- loading


def _freeze(value: Any) -> Any:
    # Lists become tuples so that configs can be compared and used as dict keys.
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    return value


def flatten_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"model.dim": 512, ...}; keys that are already dotted stay as they are."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = _freeze(value)
    return flat


@functools.cache
def _trainer_defaults() -> dict[str, Any]:
    from scalevec_train.config import Config  # imports torch: only when runs are loaded

    return flatten_config(OmegaConf.to_container(OmegaConf.structured(Config)))


def with_current_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A flattened run config plus the trainer's current default for every option it lacks. A run
    written before an option existed ran with the behaviour that option's default keeps, so it belongs
    in the same group as a newer run that leaves the option at its default."""
    out = dict(config)
    for key, value in _trainer_defaults().items():
        # a section the run holds as one value (model.moe: null) or as sub-keys is not missing
        if not any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in config):
            out[key] = value
    return out


def _numeric(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def merge_records(rows: Iterable[dict]) -> list[dict[str, float]]:
    """Logged records (in logging order, each with a `step`) -> one record per step, ascending.

    A step lower than the previous one marks a restart from an earlier checkpoint: what was logged at
    or after that step before the restart is dropped. Records of one step are merged, later keys win.
    """
    by_step: dict[int, dict[str, float]] = {}
    last = None
    for row in rows:
        step = int(row["step"])
        if last is not None and step < last:
            by_step = {s: r for s, r in by_step.items() if s < step}
        by_step.setdefault(step, {}).update(_numeric(row))
        last = step
    return [by_step[s] for s in sorted(by_step)]


def read_metrics(path: Path) -> list[dict[str, float]]:
    """metrics.jsonl -> merged records (see `merge_records`). A partial last line is skipped."""
    lines = [(i + 1, line) for i, line in enumerate(path.read_text().splitlines()) if line.strip()]
    rows = []
    for n, (lineno, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                break  # a run killed while writing leaves a partial last line
            raise ScalevecError(f"{path}:{lineno}", f"not valid JSON ({e.msg}).",
                                "repair or delete that line.") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            raise ScalevecError(f"{path}:{lineno}", "a metrics record without a numeric `step`.",
                                "every line must be a JSON object with a `step`.")
        rows.append(row)
    return merge_records(rows)


def _params_from_records(records: list[dict[str, float]]) -> float | None:
    found = [r["params"] for r in records if "params" in r]
    return float(found[-1]) if found else None


def load_run_dir(path: str | Path) -> Run:
    """A trainer run directory (config.yaml, metrics.jsonl, optional describe.json) -> Run.

    N for the scaling fit: describe.json's `total_params`, else the last `params` in the metrics.
    """
    run_dir = Path(path)
    config_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for p in (config_path, metrics_path):
        if not p.is_file():
            raise ScalevecError(str(p), "missing.",
                                "pass run directories written by the trainer (config.yaml + metrics.jsonl).")
    config = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    if not isinstance(config, dict):
        raise ScalevecError(str(config_path), "is not a mapping.", "pass the trainer's resolved config.")
    records = read_metrics(metrics_path)
    params = _params_from_records(records)
    describe = run_dir / "describe.json"
    if describe.is_file():
        total = json.loads(describe.read_text()).get("total_params")
        if total is not None:
            params = float(total)
    return Run(str(run_dir), with_current_defaults(flatten_config(config)), records, params)


def _unwrap_wandb_config(config: dict) -> dict:
    # wandb may store each top-level value as {"value": ..., "desc": ...}; `_wandb` etc. are its own.
    out = {}
    for key, value in config.items():
        if str(key).startswith("_"):
            continue
        if isinstance(value, dict) and "value" in value and set(value) <= {"value", "desc"}:
            value = value["value"]
        out[key] = value
    return out


def run_from_history(name: str, rows: Iterable[dict], config: dict, params: float | None = None) -> Run:
    """A wandb run's history rows and config -> Run. `step` falls back to wandb's `_step`."""
    converted = []
    for row in rows:
        row = {k: v for k, v in row.items() if v is not None}
        row.setdefault("step", row.get("_step"))
        if row["step"] is None:
            raise ScalevecError(name, "a history row has neither `step` nor `_step`.")
        converted.append(row)
    records = merge_records(converted)
    if params is None:
        params = _params_from_records(records)
    return Run(name, with_current_defaults(flatten_config(_unwrap_wandb_config(config))), records, params)


def parse_wandb_filter(spec: str) -> tuple[str, dict | None]:
    """'ENTITY/PROJECT:{"config.scale.name": "unified"}' -> ("ENTITY/PROJECT", {...}); the JSON is
    passed to wandb.Api().runs(filters=...) as it is. Without ':JSON' every run of the project."""
    path, _, query = spec.partition(":")
    if path.count("/") != 1 or not all(path.split("/")):
        raise ScalevecError("--wandb-filter", f"{spec!r} does not start with ENTITY/PROJECT.",
                            'write ENTITY/PROJECT:{"config.scale.name": "unified"}.')
    if not query.strip():
        return path, None
    try:
        filters = json.loads(query)
    except json.JSONDecodeError as e:
        raise ScalevecError("--wandb-filter", f"the filter after ':' is not JSON ({e.msg}).",
                            'write a JSON object, e.g. {"config.scale.name": "unified"}.') from None
    if not isinstance(filters, dict):
        raise ScalevecError("--wandb-filter", "the filter after ':' is not a JSON object.")
    return path, filters


def load_wandb(run_paths: Sequence[str] = (), filters: Sequence[str] = ()) -> list[Run]:
    """Runs from wandb: ENTITY/PROJECT/RUN_ID paths and/or `parse_wandb_filter` specs."""
    try:
        import wandb
    except ImportError:
        raise ScalevecError("--wandb", "wandb is not installed.", "pip install 'scalevec[wandb]'.") from None
    api = wandb.Api()
    found = [api.run(p) for p in run_paths]
    for spec in filters:
        path, query = parse_wandb_filter(spec)
        found.extend(api.runs(path, filters=query))
    runs = []
    for r in found:
        params = r.summary.get("params")
        runs.append(run_from_history("/".join(r.path), r.scan_history(), dict(r.config), params))
    return runs


# --------------------------------------------------------------------------------------------- grouping


def is_ignored(key: str, value: Any, extra: Sequence[str] = ()) -> bool:
    """True for config keys that differ per seed or are bookkeeping: `seed` (and any `*.seed`),
    `run_dir`, `resume`, `data.cache_dir`, `logger.*`, `checkpoint.*`, `hydra.*`, path-like keys (last
    part `dir`/`path`/`file` or ending in `_dir`/`_path`/`_file`), keys whose value is an absolute or
    home path (except `init_from`), and the keys (or sections) in `extra`."""
    last = key.rsplit(".", 1)[-1]
    if key in _IGNORED_KEYS or last == "seed" or key.startswith(_IGNORED_PREFIXES):
        return True
    if any(last == s or last.endswith("_" + s) for s in _PATH_SUFFIXES):
        return True
    # the checkpoint a run starts from changes the experiment, wherever it is kept
    if isinstance(value, str) and value.startswith(("/", "~")) and key not in _STARTING_POINT_KEYS:
        return True
    return any(key == e or key.startswith(e + ".") for e in extra)


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


def _labels(configs: list[dict[str, Any]]) -> list[str]:
    """Short distinct labels: the fewest keys, tried in a readable order, that tell the configs apart."""
    keys = sorted(set().union(*configs))
    differing = [k for k in keys if len({c.get(k, _UNSET) for c in configs}) > 1]
    ordered = [k for k in _LABEL_KEYS if k in differing] + [k for k in differing if k not in _LABEL_KEYS]
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
        return [f"scale={_fmt(c['scale.name'])}" if "scale.name" in c else "all runs" for c in configs]
    return [" ".join(f"{_short(k)}={_fmt(c.get(k, _UNSET))}" for k in chosen) for c in configs]


def group_runs(runs: Sequence[Run], ignore: Sequence[str] = ()) -> list[Group]:
    """Group runs whose configs agree on every key that `is_ignored` does not drop; in order of first
    appearance. Labels: the fewest differing keys that tell the groups apart (`_labels`)."""
    grouped: dict[tuple, tuple[dict, list[Run]]] = {}
    for run in runs:
        config = comparable_config(run, ignore)
        grouped.setdefault(tuple(sorted(config.items())), (config, []))[1].append(run)
    configs = [c for c, _ in grouped.values()]
    return [Group(label, config, members)
            for label, (config, members) in zip(_labels(configs), grouped.values(), strict=True)]


def _matches(value: Any, text: str) -> bool:
    if _fmt(value) == text:
        return True
    try:
        return float(value) == float(text)
    except (TypeError, ValueError):
        return False


def find_group(groups: Sequence[Group], spec: str) -> Group:
    """The one group whose label is `spec`, or that matches every `key=value` in it (space-separated;
    `scale` stands for `scale.name`)."""
    exact = [g for g in groups if g.label == spec]
    if exact:
        return exact[0]
    labels = "; ".join(g.label for g in groups)
    conditions = []
    for term in spec.split():
        key, sep, value = term.partition("=")
        if not sep:
            raise ScalevecError("--reference", f"{spec!r} is neither a group label nor key=value terms.",
                                f"use one of: {labels}.")
        if not any(key in g.config for g in groups) and any(key + ".name" in g.config for g in groups):
            key += ".name"
        conditions.append((key, value))
    hits = [g for g in groups if all(_matches(g.config.get(k, _UNSET), v) for k, v in conditions)]
    if len(hits) != 1:
        which = "no group" if not hits else f"{len(hits)} groups"
        raise ScalevecError("--reference", f"{spec!r} matches {which}.", f"groups are: {labels}.")
    return hits[0]


# ------------------------------------------------------------------------------------------- statistics


def metric_curve(run: Run, metric: str, last_k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, values) of a run's metric curve; for `loss`, each value is the trailing mean of the
    last `last_k` logged losses (see the module docstring)."""
    points = [r for r in run.records if metric in r]
    if not points:
        fix = "use --metric loss, or evaluate during training." if metric == "val_loss" else ""
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
    """Terminal loss per group, difference to `reference` and token efficiency (module docstring)."""
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
            efficiency=None if reached is None else reached / tokens, is_reference=g is reference))
    return rows


def ema(values: np.ndarray, beta: float) -> np.ndarray:
    """Exponential moving average s_i = beta * s_(i-1) + (1 - beta) * v_i, starting at s_0 = v_0."""
    out = np.empty(len(values), dtype=np.float64)
    acc = float(values[0])
    for i, v in enumerate(values):
        acc = beta * acc + (1.0 - beta) * float(v)
        out[i] = acc
    return out


# ----------------------------------------------------------------------------------------------- tables


def _num(x: float | None, spec: str) -> str:
    if x is None:
        return _NOT_REACHED
    return "n/a" if math.isnan(x) else format(x, spec)


def summary_markdown(rows: Sequence[GroupSummary], metric: str) -> str:
    head = (f"| group | runs | tokens | terminal {metric} | std | Δ vs ref | ref tokens to reach "
            "| token efficiency |\n|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r.label}{' (ref)' if r.is_reference else ''} | {r.runs} | {r.tokens:.4g} | {r.terminal:.4f} "
        f"| {_num(r.std, '.4f')} | {r.delta:+.4f} | {_num(r.reference_tokens, '.4g')} "
        f"| {_num(r.efficiency, '.3f')} |\n" for r in rows)
    return head + body


def write_summary_csv(rows: Sequence[GroupSummary], path: Path) -> None:
    """Full-precision numbers; `not reached` spelled out; std empty for a single run."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["group", "is_reference", "runs", "tokens", "terminal_mean", "terminal_std",
                    "delta_vs_reference", "reference_tokens", "token_efficiency"])
        for r in rows:
            w.writerow([r.label, r.is_reference, r.runs, repr(r.tokens), repr(r.terminal),
                        "" if math.isnan(r.std) else repr(r.std), repr(r.delta),
                        _NOT_REACHED if r.reference_tokens is None else repr(r.reference_tokens),
                        _NOT_REACHED if r.efficiency is None else repr(r.efficiency)])


# --------------------------------------------------------------------------------------------- plotting


def plot_curves(groups: Sequence[Group], path: Path, ema_beta: float | None = None,
                logx: bool = False, logy: bool = False) -> None:
    """Training and (when logged) validation loss against tokens: each group's mean over runs, bold,
    over its single runs, faint. `ema_beta` smooths the training-loss curves only."""
    panels = [("loss", "loss")]
    if any("val_loss" in rec for g in groups for r in g.runs for rec in r.records):
        panels.append(("val_loss", "validation loss"))
    fig = Figure(figsize=(6.5 * len(panels), 4.8), layout="constrained")
    for ax, (metric, ylabel) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        for i, g in enumerate(groups):
            runs = [r for r in g.runs if any(metric in rec for rec in r.records)]
            if not runs:
                continue
            curves = [metric_curve(r, metric) for r in runs]
            if metric == "loss" and ema_beta:
                curves = [(t, ema(v, ema_beta)) for t, v in curves]
            color = f"C{i % 10}"
            if len(curves) > 1:
                for t, v in curves:
                    ax.plot(t, v, color=color, alpha=0.25, linewidth=0.8)
            t, v = mean_curve(curves, f"group {g.label!r}")
            ax.plot(t, v, color=color, linewidth=1.6, label=f"{g.label} (n={len(curves)})")
        smoothing = f", EMA {ema_beta}" if metric == "loss" and ema_beta else ""
        ax.set_title(f"{'training loss' if metric == 'loss' else ylabel}{smoothing}")
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log" if logx else "linear")
        ax.set_yscale("log" if logy else "linear")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Loss against training tokens (mean over seeds)")
    fig.savefig(path, dpi=120)


def write_comparison(runs: Sequence[Run], reference: str, out_dir: str | Path, metric: str = "val_loss",
                     last_k: int = 1, ema_beta: float | None = None, logx: bool = False,
                     logy: bool = False, ignore: Sequence[str] = ()) -> str:
    """Group `runs`, write out_dir/curves.png, summary.md and summary.csv; return the markdown table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, ignore)
    ref = find_group(groups, reference)
    rows = summarize(groups, ref, metric, last_k)
    table = summary_markdown(rows, metric)
    (out / "summary.md").write_text(table)
    write_summary_csv(rows, out / "summary.csv")
    plot_curves(groups, out / "curves.png", ema_beta, logx, logy)
    return table


# ------------------------------------------------------------------------------------------ scaling fit


def _profile(x_base: np.ndarray, y: np.ndarray, alpha: float) -> tuple[float, float, float]:
    # For a fixed alpha the model is linear in (E, A'): least squares in closed form.
    x = np.power(x_base, -alpha)
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    intercept = float(y.mean() - slope * x.mean())
    resid = y - intercept - slope * x
    return float(resid @ resid), intercept, slope


def fit_power_law(sizes: Sequence[float], losses: Sequence[float], alpha_max: float = 4.0) -> PowerLawFit:
    """Least-squares fit of L(N) = E + A * N^(-alpha) with alpha in (0, alpha_max].

    For each alpha, E and A follow by linear least squares; alpha minimises that profile residual: a
    grid search, then golden-section refinement between the grid neighbours of the best point. Exact
    points give back their E, A, alpha. N is divided by its geometric mean for conditioning.
    """
    n = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    if len(np.unique(n)) < 3 or np.any(n <= 0):
        raise ScalevecError("scaling fit", f"needs at least 3 distinct positive sizes, got {sorted(set(n))}.",
                            "run more model sizes.")
    n0 = float(np.exp(np.log(n).mean()))
    base = n / n0
    grid = np.linspace(alpha_max / 4000, alpha_max, 4000)
    ssr = np.array([_profile(base, y, a)[0] for a in grid])
    i = int(np.argmin(ssr))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = _profile(base, y, a)[0], _profile(base, y, b)[0]
    for _ in range(200):
        if hi - lo <= 1e-14 * hi:
            break
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = _profile(base, y, a)[0]
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = _profile(base, y, b)[0]
    alpha = min((grid[i], a, b), key=lambda x: _profile(base, y, x)[0])
    ssr_best, e, slope = _profile(base, y, alpha)
    # y = E + slope * (N / n0)^(-alpha), so A = slope * n0^alpha.
    return PowerLawFit(E=e, A=slope * n0**alpha, alpha=float(alpha), rmse=math.sqrt(ssr_best / len(y)))


def scaling_series(runs: Sequence[Run], metric: str = "val_loss", last_k: int = 1,
                   series_keys: Sequence[str] = ("scale",),
                   ignore: Sequence[str] = ()) -> list[ScalingSeries]:
    """Split runs into series by the config keys under `series_keys` (default: the `scale` section, i.e.
    the strategy), average the terminal loss over the runs at each N, and fit each series.

    Runs at the same N in one series must differ only in ignored keys (the seed...), else the points
    would mix different settings: that is an error.
    """
    series: dict[tuple, dict[float, list[Run]]] = {}
    for run in runs:
        if run.params is None:
            raise ScalevecError(run.name, "no parameter count N for the scaling fit.",
                                "keep the trainer's describe.json (total_params) in the run directory, "
                                "or log a `params` value in the metrics.")
        config = comparable_config(run, ignore)
        key = tuple(sorted((k, v) for k, v in config.items()
                           if any(k == s or k.startswith(s + ".") for s in series_keys)))
        series.setdefault(key, {}).setdefault(run.params, []).append(run)
    labels = _labels([dict(k) for k in series])
    out = []
    for label, by_size in zip(labels, series.values(), strict=True):
        sizes = np.array(sorted(by_size))
        losses, counts = [], []
        for size in sizes:
            members = by_size[size]
            configs = [comparable_config(r, ignore) for r in members]
            if len({tuple(sorted(c.items())) for c in configs}) > 1:
                keys = sorted({k for c in configs for k in c if len({d.get(k, _UNSET) for d in configs}) > 1})
                raise ScalevecError(f"series {label!r} at N={size:.6g}",
                                    f"its runs differ in more than the seed: {', '.join(keys)}.",
                                    "pass one set of runs per size, or add those keys to --series.")
            losses.append(np.mean([metric_curve(r, metric, last_k)[1][-1] for r in members]))
            counts.append(len(members))
        fit = fit_power_law(sizes, losses) if len(sizes) >= 3 else None
        out.append(ScalingSeries(label, sizes, np.array(losses), np.array(counts), fit))
    return out


def scaling_markdown(series: Sequence[ScalingSeries]) -> str:
    head = "| series | sizes | runs | E | A | alpha | rmse |\n|---|---|---|---|---|---|---|\n"
    rows = []
    for s in series:
        if s.fit is None:
            fit = "| needs ≥3 sizes | | | |"
        else:
            fit = f"| {s.fit.E:.4f} | {s.fit.A:.4g} | {s.fit.alpha:.4f} | {s.fit.rmse:.2e} |"
        rows.append(f"| {s.label} | {len(s.sizes)} | {int(s.counts.sum())} {fit}\n")
    return head + "".join(rows)


def write_scaling_csv(series: Sequence[ScalingSeries], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["series", "sizes", "runs", "E", "A", "alpha", "rmse"])
        for s in series:
            fit = ["", "", "", ""] if s.fit is None else [repr(s.fit.E), repr(s.fit.A), repr(s.fit.alpha),
                                                          repr(s.fit.rmse)]
            w.writerow([s.label, len(s.sizes), int(s.counts.sum()), *fit])


def plot_scaling(series: Sequence[ScalingSeries], path: Path, metric: str = "val_loss") -> None:
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        ax.scatter(s.sizes, s.losses, color=color, zorder=3,
                   label=s.label if s.fit is None else None)
        if s.fit is not None:
            n = np.geomspace(s.sizes[0] / 1.5, s.sizes[-1] * 1.5, 200)
            ax.plot(n, s.fit(n), color=color, label=f"{s.label}: E={s.fit.E:.3f}, A={s.fit.A:.3g}, "
                                                    f"α={s.fit.alpha:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel(f"terminal {'validation loss' if metric == 'val_loss' else 'loss'}")
    ax.set_title("Scaling fit L(N) = E + A·N^(-α) per strategy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)


def write_scaling(runs: Sequence[Run], out_dir: str | Path, metric: str = "val_loss", last_k: int = 1,
                  series_keys: Sequence[str] = ("scale",), ignore: Sequence[str] = ()) -> str:
    """Fit each series, write out_dir/scaling.png, scaling.md and scaling.csv; return the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = scaling_series(runs, metric, last_k, series_keys, ignore)
    table = scaling_markdown(series)
    (out / "scaling.md").write_text(table)
    write_scaling_csv(series, out / "scaling.csv")
    plot_scaling(series, out / "scaling.png", metric)
    return table

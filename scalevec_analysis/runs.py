"""Training runs as records: read from run directories (metrics.jsonl, config.yaml, describe.json)
or from wandb, with one merged metrics record per step.

Metrics files: a resumed run appends records that repeat steps it had logged before it restarted
from an earlier checkpoint. A step lower than one already seen marks such a restart, and every
record at or after that step from before the restart is dropped. Records with the same step (a
validation record logged on its own line after the training record) are merged, later
values winning.
"""

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run.resume import read_resumes
from scalevec_train.training.logger import flatten, read_records

AVERAGED_KEY = "averaged"
# The key that sets a run resumed with changes on purpose (resume_changes) apart from one that
# was not
RESUMED_KEY = "resumed_with"
EMA_KEY = "ema"
# a run's metrics that its weight EMA's run (ema_run) holds under the run's own names, "_ema"
# dropped (val_loss_ema -> val_loss, val_loss_ema/<source> -> val_loss/<source>)
EMA_METRICS = ("val_loss_ema", "val_bpb_ema")


@dataclass
class Run:
    """One training run: its flattened config and its metrics, one merged record per step."""

    name: str
    config: dict[str, Any]
    records: list[dict[str, float]]
    params: float | None = None  # parameter count N, needed only by the scaling fit
    # training FLOPs per token, needed only for compute efficiency
    flops_per_token: float | None = None


def _freeze(value: Any) -> Any:
    # Lists become tuples so that configs can be compared and used as dict keys.
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    return value


def _index_lists(value: Any) -> Any:
    # A list of sections (data.mixture) becomes one section per item, keyed by its index, so that
    # each field (data.mixture.1.weight) groups, labels and is ignored (a path) like any other key.
    if isinstance(value, dict):
        return {k: _index_lists(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {str(i): _index_lists(v) for i, v in enumerate(value)}
    return value


def flatten_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"model.dim": 512, "data.mixture.0.weight": 0.75, ...}; keys that are
    already dotted stay as they are."""
    return {k: _freeze(v) for k, v in flatten(_index_lists(config), prefix).items()}


@functools.cache
def _trainer_defaults() -> dict[str, Any]:
    from scalevec_train.config import Config  # imports torch: only when runs are loaded

    return flatten_config(OmegaConf.to_container(OmegaConf.structured(Config)))


def with_current_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A flattened run config plus the trainer's current default for every option it lacks. A run
    written before an option existed ran with the behaviour that option's default keeps, so it
    belongs in the same group as a newer run that leaves the option at its default."""
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

    A step lower than the previous one marks a restart from an earlier checkpoint: what was logged
    at or after that step before the restart is dropped. Records of one step are merged, later
    keys win.
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
    return merge_records(read_records(path))


def _params_from_records(records: list[dict[str, float]]) -> float | None:
    found = [r["params"] for r in records if "params" in r]
    return float(found[-1]) if found else None


def load_run_dir(path: str | Path) -> Run:
    """A trainer run directory (config.yaml, metrics.jsonl, optional describe.json) -> Run.

    N for the scaling fit: describe.json's `total_params`, else the last `params` in the metrics;
    FLOPs per token for compute efficiency: describe.json's `train_flops_per_token`.
    """
    run_dir = Path(path)
    config_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for p in (config_path, metrics_path):
        if not p.is_file():
            raise ScalevecError(str(p), "missing.",
                                "pass run directories written by the trainer (config.yaml + "
                                "metrics.jsonl).")
    config = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    if not isinstance(config, dict):
        raise ScalevecError(str(config_path), "is not a mapping.",
                            "pass the trainer's resolved config.")
    records = read_metrics(metrics_path)
    params = _params_from_records(records)
    describe = run_dir / "describe.json"
    flops = None
    if describe.is_file():
        described = json.loads(describe.read_text())
        if described.get("total_params") is not None:
            params = float(described["total_params"])
        flops = described.get("train_flops_per_token")
    config = with_current_defaults(flatten_config(config))
    averaged = averaged_steps(run_dir)
    if averaged is not None:
        config[AVERAGED_KEY] = averaged
    changed = deliberate_changes(run_dir)
    if changed is not None:
        config[RESUMED_KEY] = changed
    return Run(str(run_dir), config, records, params, flops)


def deliberate_changes(run_dir: Path) -> str | None:
    """For a run resumed with changes on purpose (resume_changes: its resumes.jsonl), which keys
    changed from which step, e.g. "optim.lr from step 500"; else None."""
    found = [f"{key} from step {entry['step']}" for entry in read_resumes(run_dir)
             for key, change in entry["changes"].items() if change["kind"] == "deliberate"]
    return ", ".join(found) or None


def averaged_steps(folder: Path) -> str | None:
    """For an averaged checkpoint folder (scalevec_train/checkpoint/averaging.py, evaluated by
    scalevec_train.evaluate), the steps it averages, e.g. "200,300,400", or for the weight EMA of a
    checkpoint written out the same way, "ema@<step>"; else None. It carries its run's config.yaml,
    so this key is what sets it apart from the run in the grouping."""
    state = folder / "train_state.json"
    if not state.is_file():
        return None
    source = json.loads(state.read_text()).get("averaged_from")
    if source is None:
        return None
    steps = ",".join(str(s) for s in source["steps"])
    return f"ema@{steps}" if source.get("ema") else steps


def ema_run(run: Run) -> Run | None:
    """The weight EMA a run kept (train.ema.half_life_tokens) as a run of its own: its validation
    curves (val_loss_ema, val_bpb_ema, a mixture's val_loss_ema/<source> as val_loss, val_bpb,
    val_loss/<source>), marked `ema=half-life <tokens>` (the run's train.ema keys do not group, the
    EMA changing nothing of the run); None for a run without one."""
    kept = ("step", "tokens")
    records = [{**{k: r[k] for k in kept if k in r},
                **{k.replace("_ema", "", 1): v for k, v in r.items() if k.startswith(EMA_METRICS)}}
               for r in run.records if "val_loss_ema" in r]
    if not records:
        return None
    half_life = run.config.get("train.ema.half_life_tokens")
    return Run(f"{run.name} (ema)", {**run.config, EMA_KEY: f"half-life {half_life:g} tokens"},
               records, run.params, run.flops_per_token)


def _unwrap_wandb_config(config: dict) -> dict:
    # wandb may store each top-level value as {"value": ..., "desc": ...}; `_wandb` etc. are
    # its own.
    out = {}
    for key, value in config.items():
        if str(key).startswith("_"):
            continue
        if isinstance(value, dict) and "value" in value and set(value) <= {"value", "desc"}:
            value = value["value"]
        out[key] = value
    return out


def run_from_history(name: str, rows: Iterable[dict], config: dict,
                     params: float | None = None) -> Run:
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
    return Run(name, with_current_defaults(flatten_config(_unwrap_wandb_config(config))), records,
               params)


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
        raise ScalevecError("--wandb", "wandb is not installed.",
                            "pip install 'scalevec[wandb]'.") from None
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

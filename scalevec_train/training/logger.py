"""Where metrics go: run_dir/metrics.jsonl always, a progress bar on the console, wandb optionally;
and the one reader of metrics.jsonl (read_records) and of a nested config as flat keys (flatten).

Only rank 0 logs. wandb is imported only when logger=wandb; without an API key it runs offline.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.training.config import LoggerConfig


def wandb_mode(cfg: LoggerConfig) -> str:
    if cfg.mode != "auto":
        return cfg.mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


# Keys that differ between the seeds of one experiment arm, or are bookkeeping: not part of the
# group. A branch (branch_from) is its trunk's computation up to the branch point: it groups by its
# own settings. Downstream tasks (tasks.*) only observe the run.
_NOT_GROUPING = ("seed", "run_dir", "resume", "logger", "checkpoint", "data.cache_dir",
                 "branch_from", "tasks")


def wandb_init_args(cfg: LoggerConfig, config: dict, run_dir: Path) -> dict:
    """wandb.init arguments derived from the resolved config: a group shared by every seed of the
    same setting (readable prefix + hash of everything but the seed and bookkeeping), tags naming
    model, strategy, optimizer, schedule and seed, and the whole config."""
    flat = flatten(config)
    kept = {k: v for k, v in flat.items()
            if not any(k == n or k.startswith(n + ".") for n in _NOT_GROUPING)}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:8]
    names = [str(flat.get(f"{k}.name", "")) for k in ("model", "scale", "optim", "schedule")]
    tags = [f"model={names[0]}", f"scale={names[1]}", f"optim={names[2]}", f"schedule={names[3]}",
            f"seed={flat.get('seed')}", *cfg.tags]
    # A run resumed in the same run_dir continues the same wandb run.
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return {"project": cfg.project, "entity": cfg.entity or None,
            "group": cfg.group or f"{'-'.join(names)}-{digest}", "tags": tags, "name": run_dir.name,
            "id": run_id, "resume": "allow", "config": config}


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested config -> {"model.dim": 512, ...}; keys that are already dotted stay as they are."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _shown_task_metric(key: str) -> bool:
    return key.startswith("task/") and key.endswith("/acc")


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl in file order ([] when there is no file). A partial last line
    (a run killed while appending) is skipped; any other line that is not a JSON object with a
    numeric `step` is an error."""
    if not path.is_file():
        return []
    lines = [(i + 1, line) for i, line in enumerate(path.read_text().splitlines()) if line.strip()]
    rows = []
    for n, (lineno, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) - 1:
                break
            raise ScalevecError(f"{path}:{lineno}", f"not valid JSON ({e.msg}).",
                                "repair or delete that line.") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            raise ScalevecError(f"{path}:{lineno}", "a metrics record without a numeric `step`.",
                                "every line must be a JSON object with a `step`.")
        rows.append(row)
    return rows


def drop_partial_line(path: Path) -> None:
    """Cut off an unfinished last line of a file of JSON lines. A process killed while appending a
    record leaves one (a long record takes several writes); the resumed run logs that step again."""
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


class MetricsLogger:
    """Appends one JSON object per logged step to metrics.jsonl (after cutting off a partial last
    line a killed run left) and mirrors it to the console/wandb."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, total_steps: int, start_step: int,
                 wandb_init: dict | None = None, enabled: bool = True):
        self.enabled = enabled
        self.wandb = None
        self.bar = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
        drop_partial_line(self.path)
        self.file = self.path.open("a")
        if cfg.progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=1.0)
        if cfg.name == "wandb":
            import wandb  # only when asked for: it is heavy and optional

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(dir=str(run_dir), mode=wandb_mode(cfg), **(wandb_init or {}))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        if self.bar is not None:
            shown = {k: record[k] for k in ("loss", "val_loss") if k in record}
            if "tokens_per_s" in record:
                shown["tok/s"] = f"{record['tokens_per_s']:.0f}"
            self.bar.set_postfix(shown, refresh=False)
        else:
            # per-layer and per-site keys stay in the file; of the tasks' metrics, the accuracy
            # shows
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in record.items() if "/" not in k or _shown_task_metric(k)),
                  flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()

"""Where metrics go: run_dir/metrics.jsonl always, a progress bar on the console, wandb optionally.

Only rank 0 logs. wandb is imported only when logger=wandb; without an API key it runs offline.
"""

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from scalevec_train.errors import ScalevecError


@dataclass
class LoggerConfig:
    # console (metrics.jsonl + progress bar) | wandb (the same, plus a wandb run)
    name: str = "console"
    # show a progress bar with loss, tokens/s and ETA
    progress_bar: bool = True
    # wandb project
    project: str = "scalevec"
    # wandb entity (team or user); empty: your default
    entity: str = ""
    # wandb group; empty: derived from the config (everything but the seed)
    group: str = ""
    # extra wandb tags, added to those derived from the config
    tags: list[str] = field(default_factory=list)
    # auto (offline when no WANDB_API_KEY is set) | online | offline
    mode: str = "auto"

    def validate(self) -> None:
        if self.name not in ("console", "wandb"):
            raise ScalevecError("logger.name", f"unknown logger {self.name!r}.",
                                "use logger=console or logger=wandb.")
        if self.mode not in ("auto", "online", "offline"):
            raise ScalevecError("logger.mode", f"unknown mode {self.mode!r}.", "use auto, online or offline.")


def wandb_mode(cfg: LoggerConfig) -> str:
    if cfg.mode != "auto":
        return cfg.mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


# Keys that differ between the seeds of one experiment arm, or are bookkeeping: not part of the group.
# A branch (branch_from) is its trunk's computation up to the branch point: it groups by its own settings.
_NOT_GROUPING = ("seed", "run_dir", "resume", "logger", "checkpoint", "data.cache_dir", "branch_from")


def wandb_init_args(cfg: LoggerConfig, config: dict, run_dir: Path) -> dict:
    """wandb.init arguments derived from the resolved config: a group shared by every seed of the same
    setting (readable prefix + hash of everything but the seed and bookkeeping), tags naming model,
    strategy, optimizer, schedule and seed, and the whole config."""
    flat = _flatten(config)
    kept = {k: v for k, v in flat.items() if not any(k == n or k.startswith(n + ".") for n in _NOT_GROUPING)}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:8]
    names = [str(flat.get(f"{k}.name", "")) for k in ("model", "scale", "optim", "schedule")]
    tags = [f"model={names[0]}", f"scale={names[1]}", f"optim={names[2]}", f"schedule={names[3]}",
            f"seed={flat.get('seed')}", *cfg.tags]
    # A run resumed in the same run_dir continues the same wandb run.
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return {"project": cfg.project, "entity": cfg.entity or None, "group": cfg.group or f"{'-'.join(names)}-{digest}",
            "tags": tags, "name": run_dir.name, "id": run_id, "resume": "allow", "config": config}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class MetricsLogger:
    """Appends one JSON object per logged step to metrics.jsonl and mirrors it to the console/wandb."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, total_steps: int, start_step: int,
                 wandb_init: dict | None = None, enabled: bool = True):
        self.enabled = enabled
        self.wandb = None
        self.bar = None
        if not enabled:
            return
        self.path = run_dir / "metrics.jsonl"
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
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in record.items() if "/" not in k), flush=True)

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

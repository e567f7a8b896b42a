"""Where metrics go: run_dir/metrics.jsonl always, a progress bar on the console, wandb optionally.

Only rank 0 logs. wandb is imported only when logger=wandb; without an API key it runs offline.
"""

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

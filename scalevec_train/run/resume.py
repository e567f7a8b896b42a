"""What a run may change when it continues another's computation: a resume (resume=auto into a run
directory that holds checkpoints, or resume=<checkpoint>) or a branch (branch_from). The config the
checkpoint's run saved (its config.yaml) is compared with the new one key by key:

- keys that say how a run is executed, observed or stored (OPERATIONAL: logging, evaluation and
  checkpoint cadence, workers, compile, activation checkpointing, kernels, the tasks scored, ...)
  may change: each change is printed and kept in the run's resumes.jsonl;
- the run's length (train.steps, train.tokens_per_param) and the schedule's settings may change when
  the learning rate of every step already taken stays what it was (a resume then continues the same
  computation further; a branch's own decay is checked in branch.py the same way);
- every other key defines the trajectory (model, strategy, optimizer, data, tokenizer, seed,
  sequence length, batch, ...): a change refuses the run, naming each key with both values, unless
  the key is named in `resume_changes` (a change on purpose, e.g. a lower LR after a spike), which
  is then kept in resumes.jsonl as such and shown by compare_runs.

Keys the saved config lacks (options added since) take their defaults, as when that run is read
back.
"""

import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from scalevec_train.config import Config, from_record, read_run_config
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.optim.schedules import lr_multiplier
from scalevec_train.training.logger import flatten

# Key prefixes (a trailing dot: every key below) and keys a continuation may change freely.
OPERATIONAL = ("logger.", "checkpoint.", "distributed.", "tasks.", "data.num_workers",
               "data.cache_dir", "data.part_bytes", "data.verify", "model.kernels",
               "model.attention_backend", "train.micro_batch", "train.max_micro_batch_tokens",
               "train.log_every", "train.eval_every", "train.eval_batches", "train.max_bad_steps",
               "train.spike_factor", "train.profile_steps", "train.profile_record_shapes",
               "train.profile_all_ranks", "train.diagnostics_every", "train.ema.", "device")
# Where a run starts and is written, not what it computes: not compared (a copied run, a resume=auto
# of a run started with resume=none, a resumed branch).
IGNORED = ("run_dir", "resume", "resume_changes", "init_from", "branch_from")
# Keys that may change while the learning rate of every step taken stays the same.
LENGTH = ("train.steps", "train.tokens_per_param", "schedule.")
RESUMES_FILE = "resumes.jsonl"


def saved_config(train_state: dict, checkpoint: Path) -> Config | None:
    """The config of the run that wrote `checkpoint`: the one its train state holds, else
    (checkpoints written before it held one) its run directory's config.yaml; None when neither
    exists."""
    if "config" in train_state:
        return from_record(train_state["config"])
    run_dir = checkpoint.parent.parent
    return read_run_config(run_dir) if (run_dir / "config.yaml").is_file() else None


def as_record(cfg: Config) -> dict:
    """The config as the train state of a checkpoint holds it."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def same_lr_until(saved: Config, new: Config, steps: int) -> bool:
    """Whether the schedules give every one of the first `steps` steps the same LR multiplier."""
    return all(lr_multiplier(saved.schedule, s, saved.train.steps)
               == lr_multiplier(new.schedule, s, new.train.steps) for s in range(steps))


def changes(saved: Config, new: Config, step: int, length_checked: bool = False) -> dict[str, dict]:
    """{key: {"from", "to", "kind"}} of every key that differs; kind: operational, length
    (train.steps, train.tokens_per_param, schedule.*, allowed when the LRs of the `step` steps taken
    agree, or `length_checked` when the caller checks that itself), deliberate
    (named in new.resume_changes) or trajectory (refused)."""
    old, now = flatten(as_record(saved)), flatten(as_record(new))
    lr_kept = length_checked or same_lr_until(saved, new, step)
    found = {}
    for key in sorted(set(old) | set(now)):
        if old.get(key) == now.get(key) or key in IGNORED:
            continue
        if _matches(key, OPERATIONAL):
            kind = "operational"
        elif _matches(key, LENGTH) and lr_kept:
            kind = "length"
        elif key in new.resume_changes:
            kind = "deliberate"
        else:
            kind = "trajectory"
        found[key] = {"from": old.get(key), "to": now.get(key), "kind": kind}
    return found


def check_continuation(saved: Config, new: Config, step: int, source: Path, what: str,
                       length_checked: bool = False) -> dict[str, dict]:
    """The changes from `saved` (the config of the run that wrote checkpoint `source`) to `new`,
    continued from step `step`; raises, naming every refused key, when one defines the
    trajectory."""
    found = changes(saved, new, step, length_checked)
    refused = {k: v for k, v in found.items() if v["kind"] == "trajectory"}
    if refused:
        listed = "; ".join(f"{k}: {v['from']!r} there, {v['to']!r} here"
                           for k, v in refused.items())
        keys = ",".join(refused)
        raise ScalevecError(f"{what} from {source}",
                            f"this run's config changes what the run computes: {listed}.",
                            "use the overrides that run used; or, to change them on purpose from "
                            f"step {step} on, add resume_changes=[{keys}]; or give this run "
                            "another run_dir.")
    return found


def record(run_dir: Path, step: int, source: Path, found: dict[str, dict]) -> None:
    """Print what changed and append it to run_dir/resumes.jsonl (a continuation with no change adds
    nothing, so that a plain resume leaves the run directory as it was)."""
    if not found:
        return
    shown = ", ".join(f"{k} {v['from']!r} -> {v['to']!r}"
                      + (" (on purpose)" if v["kind"] == "deliberate" else "")
                      for k, v in found.items())
    print(f"continuing from step {step} of {source} with changes: {shown}", file=sys.stderr)
    entry = {"step": step, "from": str(source), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
             "changes": found}
    with open(run_dir / RESUMES_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_resumes(run_dir: Path) -> list[dict]:
    """The entries of run_dir/resumes.jsonl, oldest first ([] without one)."""
    path = run_dir / RESUMES_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

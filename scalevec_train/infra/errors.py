"""The exception types for bad user input (configs, data, checkpoints) and for a run that diverged.

Entry points catch them, print the message on one line and exit with `exit_code`, so that a user
sees what is wrong and how to fix it instead of a traceback. Any other exception is a bug and keeps
its traceback (exit code 1).
"""

from dataclasses import field, fields
from typing import Any, get_args


class ScalevecError(Exception):
    """Bad input. `where` names the config key or file; `fix` says what to do about it."""

    exit_code = 2

    def __init__(self, where: str, problem: str, fix: str = ""):
        self.where, self.problem, self.fix = where, problem, fix
        msg = f"{where}: {problem}"
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)


class DivergedError(ScalevecError):
    """Training stopped after train.max_bad_steps consecutive non-finite steps; the last good state
    is saved. Its own exit code tells it apart from bad input."""

    exit_code = 3


class CheckpointWriteError(ScalevecError):
    """A checkpoint could not be written (a full disk, an I/O error): the run stops, its previous
    complete checkpoint intact. Its own exit code tells it apart from bad input."""

    exit_code = 4


class HungError(ScalevecError):
    """The run made no progress within the hang watchdog's bound (parallel/watchdog.py), or got
    SIGTERM while it made none: it names the ranks that did not arrive and where. Not raised: the
    watchdog's thread prints it and ends the process, whose main thread is stuck. Its own exit code
    tells it apart."""

    exit_code = 5


def listing(items: list[str], limit: int = 5) -> str:
    """The first `limit` items and how many more: for error messages that name what is wrong."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def choice(default: str, options: Any) -> Any:
    """A config field whose values are the arguments of the Literal type `options`. The field stays
    annotated `str` (OmegaConf's structured configs take no Literal); check_choices checks it."""
    return field(default=default, metadata={"choices": get_args(options)})


def check_choices(cfg: Any, prefix: str) -> None:
    """The one check of every choice() field of the dataclass `cfg` (its options under `prefix`,
    e.g. "model.moe."): its value must be one of the field's Literal's."""
    for f in fields(cfg):
        allowed = f.metadata.get("choices")
        value = getattr(cfg, f.name)
        if allowed is not None and value not in allowed:
            raise ScalevecError(f"{prefix}{f.name}", f"unknown value {value!r}.",
                                f"use one of: {', '.join(allowed)}.")

"""The command line of every command but train (which is Hydra's own, with its sweeps): positional
arguments first (a run directory, a checkpoint), then `key=value` pairs. A key the command declares
is its own option; any other is a config override, composed by Hydra as train's are, where the
command takes the config (describe, coord_check, prepare_data) and refused where it does not.

A command declares its options once, as a dataclass whose fields are option() or positional(), each
with its default and one line of documentation; `main(argv, Options, body)` parses, runs
`body(options)` (or `body(options, config)`) and returns its exit code. A bad argument, or a value
the options' __post_init__ refuses, prints one error line (what, and the fix) and the usage, and
exits 2.
"""

import dataclasses
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

from scalevec_train.infra.errors import ScalevecError

_DOC, _POSITIONAL = "doc", "positional"


class UsageError(ScalevecError):
    """An argument the command cannot take: reported with the usage."""


def option(doc: str, default: Any = dataclasses.MISSING) -> Any:
    """A `key=value` option (required when it has no default)."""
    return dataclasses.field(default=default, metadata={_DOC: doc})


def positional(doc: str) -> Any:
    """A positional argument (required)."""
    return dataclasses.field(metadata={_DOC: doc, _POSITIONAL: True})


def _command(options: type) -> str:
    # under `python -m`, the command's module is __main__; its spec keeps the name users type
    spec = getattr(sys.modules.get(options.__module__), "__spec__", None)
    return spec.name if spec is not None else options.__module__


def usage(options: type, overrides: bool) -> str:
    """The usage line, then a line per argument with its documentation."""
    fields = dataclasses.fields(options)
    words, lines = [], []
    for f in fields:
        if f.metadata.get(_POSITIONAL):
            words.append(f"<{f.name}>")
        elif f.default is dataclasses.MISSING:
            words.append(f"{f.name}=...")
        else:
            words.append(f"[{f.name}={_shown(f.default) or '...'}]")
        lines.append(f"  {f.name:<12} {f.metadata[_DOC]}")
    if overrides:
        words.append("[config overrides]")
        lines.append(f"  {'overrides':<12} any other key=value: the config as train takes it "
                     "(model=..., optim.lr=...)")
    return "\n".join([f"usage: python -m {_command(options)} {' '.join(words)}", *lines])


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return "" if value is None else str(value)


def _value(key: str, text: str, kind: Any) -> Any:
    """`text` as the option's annotated type: bool (true/false), int, float, str, Path, a tuple or
    list of them (`1,2,4` or `[1,2,4]`), or such a type or None (no value)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in args if a is not type(None))
        args = typing.get_args(kind)
    origin = typing.get_origin(kind)
    try:
        if origin in (tuple, list):
            return origin(_value(key, item.strip(), args[0])
                          for item in text.strip("[]").split(",") if item.strip())
        if kind is bool:
            if text not in ("true", "false"):
                raise ValueError(text)
            return text == "true"
        return kind(text)
    except ValueError:
        raise UsageError(key, f"{text!r} is not {_kind_name(kind, origin)}.",
                         f"give {key}=<{_kind_name(kind, origin)}>.") from None


def _kind_name(kind: Any, origin: Any) -> str:
    if origin in (tuple, list):
        return "a list of numbers such as 1,2,4"
    return {bool: "true or false", int: "a whole number", float: "a number"}.get(kind, "a value")


def parse(argv: list[str], options: type, overrides: bool = False) -> tuple[Any, list[str]]:
    """(the command's options, the config overrides) of a command line."""
    fields = dataclasses.fields(options)
    named = {f.name: f for f in fields if not f.metadata.get(_POSITIONAL)}
    wanted = [f for f in fields if f.metadata.get(_POSITIONAL)]
    kinds = typing.get_type_hints(options)
    values: dict[str, Any] = {}
    given: list[str] = []
    rest: list[str] = []
    for i, arg in enumerate(argv):
        key, eq, text = arg.partition("=")
        if overrides and arg.startswith(("+", "~")):  # Hydra's additions and deletions
            rest.append(arg)
        elif arg.startswith("-"):
            flag = key.lstrip("-")
            if flag in named:  # a flag of the old form, e.g. evaluate's --tasks X
                value = text if eq else (argv[i + 1] if i + 1 < len(argv) else "<value>")
                raise UsageError(arg, "options are key=value, not flags.", f"use {flag}={value}.")
            raise UsageError(arg,
                             "is no option of this command (options are key=value, not flags).",
                             "see the usage below.")
        elif not eq:
            if len(given) == len(wanted):
                fix = (f"give only {' '.join(f'<{f.name}>' for f in wanted)}" if wanted
                       else "give key=value pairs")
                raise UsageError(arg, "is one positional argument too many.", f"{fix}.")
            given.append(arg)
        elif not key:
            raise UsageError(arg, "has no key before its '='.", "give key=value.")
        elif key in named:  # given twice: the last counts, as for an override
            values[key] = _value(key, text, kinds[key])
        elif overrides:
            rest.append(arg)
        else:
            known = ", ".join(named) or "none"
            raise UsageError(key, "is no option of this command.",
                             f"use one of its options: {known}.")
    if len(given) < len(wanted):
        missing = wanted[len(given)]
        raise UsageError(f"<{missing.name}>", "is missing.", f"give {missing.metadata[_DOC]}.")
    absent = [f.name for f in named.values()
              if f.default is dataclasses.MISSING and f.name not in values]
    if absent:
        raise UsageError(absent[0], "is missing.",
                         f"give {absent[0]}=<{named[absent[0]].metadata[_DOC]}>.")
    values.update((f.name, _value(f.name, text, kinds[f.name]))
                  for f, text in zip(wanted, given, strict=True))
    try:
        return options(**values), rest
    except ScalevecError as e:  # the options' own checks (__post_init__)
        raise UsageError(e.where, e.problem, e.fix) from None


def compose(overrides: list[str]):
    """The config that Hydra composes with the overrides (untyped: what config.to_config types)."""
    # Imported here: a command that takes no config (and prepare_data's encoding workers, which
    # import their command again) starts without Hydra and torch.
    from hydra.errors import HydraException

    from scalevec_train.config import compose_raw

    try:
        return compose_raw(overrides)
    except HydraException as e:
        problem = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".") + "."
        raise UsageError("config overrides", problem, "override keys and presets of configs/ as "
                         "train takes them (e.g. model=dense-tiny optim.lr=0.01).") from None


def main(argv: list[str], options: type, body: Callable[..., int], overrides: bool = False) -> int:
    """Parse `argv`, run `body(options)`, or `body(options, config)` for a command that takes config
    overrides, and return its exit code; bad input prints its one error line (and for a bad argument
    the usage) and returns the error's exit code."""
    if argv in (["-h"], ["--help"]):
        print(usage(options, overrides))
        return 0
    try:
        parsed, rest = parse(argv, options, overrides)
        return body(parsed, compose(rest)) if overrides else body(parsed)
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, UsageError):
            print(usage(options, overrides), file=sys.stderr)
        return e.exit_code


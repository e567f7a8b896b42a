"""The run directories of a sweep's points (Hydra multirun): every key the sweep varies is named in
them, and no two points share one.

The sweeper (hydra_plugins/scalevec_sweeper, `hydra/sweeper: scalevec` in configs/config.yaml)
expands a sweep as Hydra's basic sweeper does, then hands the points here before any of them runs,
whatever the launcher (the basic one, joblib, SLURM): each point gets `run_dir=<its directory>` as
one more override.

- A key the sweep varies that the points' run_dir does not already tell apart (the default name
  holds the model, strategy, optimizer, schedule and seed; a preset's may hold more) is appended to
  the last part of each point's run_dir as `-<key>_<value>`, in the order the sweep lists its keys:
  a sweep of `optim.lr=1e-3,3e-3` writes `runs/dense-tiny-baseline-adamw-cosine-s0-optim.lr_0.001`
  and `..._0.003`. The names follow from the sweep alone, so the same sweep again (with resume=auto)
  finds its runs.
- A run_dir given on the command line is taken as it is: the user chose it.
- Points that would still share a run directory refuse the whole sweep, before anything is written.
"""

import dataclasses
import os
import re
from collections.abc import Callable, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from scalevec_train.config import from_record
from scalevec_train.infra.errors import ScalevecError, listing

# what a value may keep in a folder name (and a Hydra override)
_UNSAFE = re.compile(r"[^A-Za-z0-9._+@-]+")


def name_points(points: Sequence[Sequence[str]],
                compose: Callable[[list[str]], DictConfig]) -> list[list[str]]:
    """Each point's overrides with its run_dir added (see the module's docstring); `compose` gives
    the config Hydra composes for a point's overrides. Raises ScalevecError if two points would
    share one."""
    if len(points) < 2:
        return [list(p) for p in points]
    parser = OverridesParser.create()
    parsed = [parser.parse_overrides(list(p)) for p in points]
    configs = [compose(list(p)) for p in points]
    typed = [_typed(cfg) for cfg in configs]
    values = [{o.key_or_group: _value(o, cfg, t) for o in point}
              for point, cfg, t in zip(parsed, configs, typed)]
    keys = [o.key_or_group for o in parsed[0]]  # the same for every point: the sweep is a product
    varying = [k for k in keys
               if not k.startswith("hydra") and len({point[k] for point in values}) > 1]
    bases = [str(OmegaConf.select(cfg, "run_dir")).rstrip("/") for cfg in configs]
    named = [] if "run_dir" in keys else [k for k in varying if not _told_apart(k, bases, values)]
    dirs = [base + "".join(f"-{k}_{_UNSAFE.sub('_', point[k]).strip('_') or '_'}" for k in named)
            for base, point in zip(bases, values)]
    _refuse_shared(dirs, [[o.input_line for o in point] for point in parsed], values, varying,
                   "run_dir" in keys)
    if not named:
        return [list(p) for p in points]
    return [[*p, f"run_dir={_quoted(d)}"] for p, d in zip(points, dirs)]


def _typed(cfg: DictConfig) -> object:
    """The point's config as the run types it (a Config), or its composed config where that fails:
    the point's own run then says what is wrong with it, as without a sweep."""
    try:
        return from_record(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    except OmegaConfBaseException:
        return cfg


def _value(override: Override, cfg: DictConfig, node: object) -> str:
    """A point's value of a key: a config group's option as chosen (in its composed config `cfg`),
    an option's value as the typed config `node` (a Config; see _typed) holds it (so 1e-3 and 0.001
    are one value, 0.001; and 0 and 0.0 of a float option one, 0.0)."""
    key = override.key_or_group
    if key in cfg.hydra.runtime.choices or key.startswith("hydra"):
        return override.get_value_element_as_str()
    if isinstance(node, DictConfig):  # a config its run will refuse: as composed
        node = OmegaConf.select(node, key, default=None, throw_on_resolution_failure=False)
    else:
        for part in key.split("."):
            node = (node[int(part)] if isinstance(node, list) and part.isdigit()
                    else getattr(node, part, None))
    if (node is None or dataclasses.is_dataclass(node) or isinstance(node, list | dict)
            or OmegaConf.is_config(node)):
        return override.get_value_element_as_str()
    return str(node)


def _told_apart(key: str, dirs: list[str], values: list[dict[str, str]]) -> bool:
    """Whether points of different values of `key` never share a directory among `dirs`."""
    seen: dict[str, str] = {}
    return all(seen.setdefault(os.path.abspath(d), point[key]) == point[key]
               for d, point in zip(dirs, values))


def _refuse_shared(dirs: list[str], lines: list[list[str]], values: list[dict[str, str]],
                   varying: list[str], given: bool) -> None:
    """Raises if two of `dirs` are one directory, naming the points by their overrides (`lines`)."""
    by_dir: dict[str, list[int]] = {}
    for i, d in enumerate(dirs):
        by_dir.setdefault(os.path.abspath(d), []).append(i)
    shared = [group for group in by_dir.values() if len(group) > 1]
    if not shared:
        return
    group = shared[0]
    where = dirs[group[0]] + (f" ({len(shared) - 1} more directories are shared)"
                              if len(shared) > 1 else "")
    differ = [k for k in varying if len({values[i][k] for i in group}) > 1]
    if not differ:
        raise ScalevecError("run_dir", f"the sweep lists the point [{' '.join(lines[group[0]])}] "
                            f"{len(group)} times (values that read differently but are one, such "
                            f"as 1e-3 and 0.001); its runs would share {where}, and nothing was "
                            "run.",
                            "drop the repeated value.")
    shown = [" ".join(line for line in lines[i] if line.split("=", 1)[0].lstrip("+~") in differ)
             for i in group]
    if given:
        fix = (f"name {', '.join(differ)} in run_dir "
               f"(e.g. run_dir='{dirs[group[0]]}-${{{differ[0]}}}'), or leave run_dir out: the "
               "default names every key a sweep varies.")
    else:
        fix = (f"set run_dir to name {', '.join(differ)} yourself "
               "(their values read alike in a folder name).")
    raise ScalevecError("run_dir", f"the sweep's points {listing([f'[{p}]' for p in shown])} would "
                        f"share {where}, and two runs in one directory overwrite each other; "
                        "nothing was run.", fix)


def _quoted(path: str) -> str:
    """`path` as a quoted Hydra override value."""
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"

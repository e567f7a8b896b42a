"""Shared test utilities: composing configs the way the entry points do, loading or running a
script, writing a run directory as the trainer does."""

import contextlib
import copy
import importlib.util
import inspect
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from types import ModuleType

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from scalevec_train.config import CONFIG_DIR, Config, compose_config, compose_raw, to_config
from scalevec_train.data.loader import Batch

# the repository root (configs/, scripts/)
REPO = Path(__file__).resolve().parents[2]


def make_config(*overrides: str, world_size: int = 1) -> Config:
    return compose_config(list(overrides), world_size)


def make_config_at(overrides: Iterable[str], world_sizes: Iterable[int]) -> dict[int, Config]:
    """make_config at each world size, composed once: Hydra's composition does not depend on the
    ranks (to_config does), and a compose costs ~0.3 s."""
    return {ranks: make_config_shared(*overrides, world_size=ranks) for ranks in world_sizes}


def make_configs(points: Iterable[list[str]], world_size: int = 1) -> list[Config]:
    """make_config of each list of overrides, in order. Points that differ only in option values
    (not in a config group, nor with a +/~ prefix or a package) share one Hydra compose of the rest,
    kept for the process (configs/ does not change during a run); their values are then applied by
    Hydra's own code for them, which compose runs the same way: after composing the defaults, in
    order. A sweep of N seeds composes once instead of N times."""
    parser, out = OverridesParser.create(), []
    for point in points:
        parsed = parser.parse_overrides(list(point))
        is_value = [o.package is None and not (o.is_add() or o.is_delete() or o.is_force_add())
                    and not (Path(CONFIG_DIR) / o.key_or_group).is_dir() for o in parsed]
        values = [o for o, v in zip(parsed, is_value) if v]
        rest = tuple(o.input_line for o, v in zip(parsed, is_value) if not v)
        if rest not in _COMPOSED:
            _COMPOSED[rest] = compose_raw(list(rest))
        raw = copy.deepcopy(_COMPOSED[rest])
        ConfigLoaderImpl._apply_overrides_to_config(values, raw)
        out.append(to_config(raw, world_size))
    return out


_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


def make_config_shared(*overrides: str, world_size: int = 1) -> Config:
    """make_config through make_configs: a compose shared with every earlier call that chose the
    same config groups."""
    return make_configs([list(overrides)], world_size)[0]


def hide_package(monkeypatch, name: str) -> None:
    """Make package `name` look uninstalled for the rest of the test (monkeypatch restores it): it
    and its submodules already imported are set to None in sys.modules, so that `import name` and
    `from name.sub import x` raise ModuleNotFoundError and importlib.util.find_spec(name) returns
    None."""
    for key in [key for key in sys.modules if key.startswith(f"{name}.")] + [name]:
        monkeypatch.setitem(sys.modules, key, None)


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """A script outside the packages (scripts/...) imported as a module, its main() not run."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args) -> subprocess.CompletedProcess:
    """scripts/<name> run in a child Python from the repository root, its output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO)


def call_main(main: Callable[[], object], argv: list[str]) -> int:
    """`main()` called with sys.argv `argv`, as the interpreter would run a script: its exit status,
    SystemExit's included (a message printed to stderr, exit status 1)."""
    saved = sys.argv
    sys.argv = argv
    try:
        code = main()
    except SystemExit as e:
        code = e.code
        if not isinstance(code, int) and code is not None:
            print(code, file=sys.stderr)
            code = 1
    finally:
        sys.argv = saved
    return code or 0


def run_main(main: Callable, *args) -> subprocess.CompletedProcess:
    """A script's main called in this process as run_script would run the script: with args as its
    argv (its parameter, or sys.argv where it takes none), its exit status and what it printed. For
    a script whose command line one run_script already covers: a child Python importing torch again
    costs seconds."""
    argv, out, err = list(map(str, args)), io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = call_main(partial(main, argv) if inspect.signature(main).parameters else main,
                         [main.__module__, *argv])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def write_run(root: Path, name: str, cfg: dict, rows: list[dict],
              params: float | None = None) -> Path:
    """A run directory as the trainer writes it: config.yaml, metrics.jsonl, and with `params`,
    describe.json's total_params."""
    d = root / name
    d.mkdir()
    OmegaConf.save(OmegaConf.create(cfg), d / "config.yaml")
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if params is not None:
        (d / "describe.json").write_text(json.dumps({"total_params": params, "layers": 2}))
    return d


# A few CPU steps of tiny batches: one evaluation batch, no periodic evaluation, one data worker.
SHORT_RUN = ["train.seq_len=32", "train.global_batch=4", "train.micro_batch=4",
             "train.eval_batches=1", "train.eval_every=0", "schedule.warmup_steps=1", "device=cpu",
             "data.num_workers=1"]


class ListLoader:
    """A loader that hands out the given batches in order (what a test trains the Trainer on
    directly)."""

    def __init__(self, batches: list[Batch]):
        self.batches = iter(batches)

    def next_batch(self) -> Batch:
        return next(self.batches)

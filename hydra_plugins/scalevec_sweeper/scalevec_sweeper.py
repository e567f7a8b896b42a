"""Hydra's basic sweeper, whose points never share a run directory
(scalevec_train/run/sweep.py); configs/
hydra/sweeper/scalevec.yaml selects it. It lives here because Hydra instantiates plugins from the
hydra_plugins package only."""

import sys
from collections.abc import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override


class ScalevecSweeper(BasicSweeper):
    def split_arguments(self, overrides: list[Override],
                        max_batch_size: int | None) -> list[list[list[str]]]:
        """Hydra's expansion of the sweep, every point named; called by sweep() before it writes
        anything (runs/multirun.yaml) or launches a point. A sweep whose points would share a run
        directory exits here with one line, as the trainer does for bad input."""
        from scalevec_train.infra.errors import ScalevecError
        from scalevec_train.run.sweep import name_points

        (points,) = BasicSweeper.split_arguments(overrides, None)
        try:
            named = name_points(points, self._compose)
        except ScalevecError as e:
            sys.stderr.write(f"error: {e}\n")
            sys.exit(e.exit_code)
        return ([named] if max_batch_size is None
                else list(self.split_overrides_to_chunks(named, max_batch_size)))

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Nothing left to check: split_arguments composed every point."""

    def _compose(self, point: list[str]):
        return self.hydra_context.config_loader.load_sweep_config(self.config, point)

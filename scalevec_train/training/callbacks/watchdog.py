"""Bounded waits: collectives get distributed.timeout_s once this process's first step has finished
(until then distributed.init_timeout_s, for joining, data preparation, the checkpoint load and the
first compile), and from then on the hang watchdog (parallel/watchdog.py) ends a run that makes no
progress."""

import sys
from pathlib import Path

from scalevec_train.infra import progress
from scalevec_train.parallel.config import DistributedConfig
from scalevec_train.parallel.process_group import set_timeout
from scalevec_train.parallel.watchdog import Watchdog
from scalevec_train.training.trainer import Callback, Trainer


class HangWatchdog(Callback):
    """Starts the watchdog with the fit (`cfg.hang_s` 0: none), arms it and shortens the
    collectives' timeout after the first step, and stops it when the fit ends. The phases it watches
    are marked by the trainer, the loaders, the evaluations and the checkpoint manager
    (infra/progress.py)."""

    def __init__(self, cfg: DistributedConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.watchdog: Watchdog | None = None
        self.first_done = False

    def on_fit_start(self, trainer: Trainer) -> None:
        if self.cfg.hang_s:
            self.watchdog = Watchdog(progress.current, self.cfg.hang_s, self.run_dir,
                                     self.cfg.sigterm_grace_s).start()

    def on_step_done(self, trainer: Trainer) -> None:
        if not self.first_done:
            self.first_done = True
            set_timeout(self.cfg.timeout_s)
            if self.watchdog is not None:
                self.watchdog.armed = True

    def on_close(self, trainer: Trainer) -> None:
        if self.watchdog is not None:
            # in the fit's finally clause: the error the fit ends with, if any
            if (error := sys.exc_info()[1]) is not None:
                self.watchdog.follow(error)
            self.watchdog.stop()
            self.watchdog = None

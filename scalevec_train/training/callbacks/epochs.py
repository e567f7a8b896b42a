"""How often a run goes over its training data: `epochs` in every logged record (`epochs/<source>`
for a mixture), and a warning at the start when the whole run would repeat the data (any one source
of a mixture) more than data.max_repeats times."""

import sys

from scalevec_train.parallel.process_group import is_main
from scalevec_train.training.trainer import Callback, Trainer


class EpochMonitor(Callback):
    """Reads the trainer's loader (data/loader.py, Loader): `epochs_at(position)`, the passes over
    the training split (each source's) after `position` sequences drawn by all ranks."""

    def __init__(self, max_repeats: float):
        self.max_repeats = max_repeats

    def on_fit_start(self, trainer: Trainer) -> None:
        loader, steps = trainer.loader, trainer.schedule.steps
        sequences = steps * (trainer.recipe.tokens_per_step // loader.seq_len)
        for name, planned in loader.epochs_at(sequences).items():
            if planned > self.max_repeats and is_main():
                what = f"source {name!r} of the mixture" if name else "the training data"
                print(f"warning: the run's {steps} steps take {planned:.1f} passes over {what} "
                      f"(sequences of {loader.seq_len} tokens), more than "
                      f"data.max_repeats={self.max_repeats:g}: repeated data is worth less and "
                      "less. Use more data (data.source=python_env, a larger data.path, "
                      "data.max_corpus_bytes=0, a larger max_tokens or a smaller weight of a "
                      "mixture's source) or fewer steps.", file=sys.stderr)

    def on_log(self, trainer: Trainer) -> None:
        for name, passes in trainer.loader.epochs_at(trainer.loader.position).items():
            trainer.record(f"epochs/{name}" if name else "epochs", passes)

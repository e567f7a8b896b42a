"""How often a run goes over its training data: `epochs` in every logged record, and a warning at the
start when the whole run would repeat the data more than a few times."""

import sys

from scalevec_train.parallel.process_group import is_main
from scalevec_train.training.trainer import Callback, Trainer

# Up to about 4 passes, repeated tokens are worth nearly as much as fresh ones; beyond, their value falls
# quickly (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models").
MAX_EPOCHS = 4.0


class EpochMonitor(Callback):
    """Reads the trainer's loader: `position` (sequences drawn by all ranks) over `num_windows` (the
    sequences of one pass over the training split)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        loader = trainer.loader
        sequences_per_step = trainer.tokens_per_step // loader.seq_len
        planned = trainer.steps * sequences_per_step / loader.num_windows
        if planned > MAX_EPOCHS and is_main():
            print(f"warning: the run's {trainer.steps} steps take {planned:.1f} passes over the training data "
                  f"({loader.num_windows:,} sequences of {loader.seq_len} tokens), more than {MAX_EPOCHS:g}: "
                  "repeated data is worth less and less. Use more data (data.source=python_env, a larger "
                  "data.path, data.max_corpus_bytes=0) or fewer steps.", file=sys.stderr)

    def on_log(self, trainer: Trainer) -> None:
        trainer.record("epochs", trainer.loader.position / trainer.loader.num_windows)

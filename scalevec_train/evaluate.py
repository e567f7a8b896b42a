"""`python -m scalevec_train.evaluate <run_dir or checkpoint> [tasks=embedded|standard|run]
[verify=false]`: the validation loss and bits per byte of a checkpoint on its run's validation set,
as the trainer computes them, and with `tasks=` downstream task metrics; an averaged checkpoint also
gets them in its metrics.jsonl (run/checkpoint_eval.py says what each means). `verify=false` reads
the checkpoint without checking it against its checksums first."""

import sys
from dataclasses import dataclass

from scalevec_train.run import cli
from scalevec_train.run.checkpoint_eval import evaluate


@dataclass
class Options:
    path: str = cli.positional("a run directory, one checkpoints/step_N, or an averaged folder")
    tasks: str = cli.option("also score downstream tasks: embedded, standard (configs/tasks/) or "
                            "run (its own)", "")
    verify: bool = cli.option("check the checkpoint against its checksums before reading it", True)


def run(o: Options) -> int:
    metrics, written = evaluate(o.path, o.tasks, o.verify)
    for name, value in metrics.items():
        print(f"{name} {value:.6f}")
    if written:
        print(f"(recorded in {written})")
    return 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

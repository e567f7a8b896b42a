"""`python -m scalevec_train.average <run_dir> last=3 out=<dir>` (or steps=[100,200,300]): the mean
of checkpoints of one run as a checkpoint folder that scalevec_train.load and export read
(checkpoint/averaging.py says what it holds). `ema=last` (or ema=<step>) writes instead the EMA of
the weights that the run kept (train.ema.half_life_tokens) in its newest checkpoint
(or that step's). `verify=false` reads the checkpoints without checking them against their checksums
first."""

import sys
from dataclasses import dataclass

from scalevec_train.checkpoint.averaging import average, ema_model
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run import cli


@dataclass
class Options:
    run_dir: str = cli.positional("the run directory whose checkpoints are read")
    out: str = cli.option("the new folder the result is written to")
    last: int | None = cli.option("average the newest N complete checkpoints", None)
    steps: list[int] | None = cli.option("average the checkpoints of these steps, e.g. "
                                         "[200,300,400]", None)
    ema: str | None = cli.option("last or a step: write the weight EMA the run kept in that "
                                 "checkpoint", None)
    verify: bool = cli.option("check the checkpoints against their checksums before reading them",
                              True)

    def __post_init__(self) -> None:
        if not self.out:
            raise ScalevecError("out", "is empty.", "give out=<a new folder>.")
        chosen = [k for k in ("last", "steps", "ema") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ScalevecError("/".join(chosen) or "last/steps/ema",
                                "say which checkpoints to read: exactly one of them is needed.",
                                "give one of last=N, steps=[a,b,...], ema=last, ema=<step>.")
        if self.ema is not None and self.ema != "last" and not self.ema.isdigit():
            raise ScalevecError("ema", f"{self.ema!r} is neither last nor a step.",
                                "give ema=last or ema=<step>.")


def run(o: Options) -> int:
    if o.ema is not None:
        out = ema_model(o.run_dir, o.out, None if o.ema == "last" else int(o.ema), o.verify)
    else:
        out = average(o.run_dir, o.out, last=o.last, steps=o.steps, verify=o.verify)
    print(f"{'the EMA written' if o.ema is not None else 'averaged'} into {out}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m scalevec_train.average <run_dir> last=3 out=<dir>` (or steps=[100,200,300]): the mean of
checkpoints of one run as a checkpoint folder that scalevec_train.load and export read
(checkpoint/average.py says what it holds). `ema=last` (or ema=<step>) writes instead the EMA of the
weights that the run kept (train.ema.half_life_tokens) in its newest checkpoint (or that step's).
`verify=false` reads the checkpoints without checking them against their checksums first."""

import sys

from scalevec_train.checkpoint.averaging import average, ema_model
from scalevec_train.infra.errors import ScalevecError

USAGE = ("usage: python -m scalevec_train.average <run_dir> (last=N | steps=[a,b,...] | ema=last | ema=N) "
         "out=<folder> [verify=false]")


def parse(options: dict[str, str]) -> dict | None:
    """average()'s keyword arguments from the command line's (`ema`: ema_model()'s step, None for the
    newest), or None when they are not usable."""
    verify = options.pop("verify", "true")
    if "out" not in options or not options["out"] or len(set(options) - {"out"}) != 1 or verify not in (
            "true", "false"):
        return None
    common = {"out": options["out"], "verify": verify == "true"}
    try:
        if "last" in options:
            return {**common, "last": int(options["last"])}
        if "steps" in options:
            steps = [int(s) for s in options["steps"].strip("[]").split(",") if s.strip()]
            return {**common, "steps": steps}
        if "ema" in options:
            return {**common, "ema": None if options["ema"] == "last" else int(options["ema"])}
    except ValueError:
        return None
    return None


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    kwargs = parse(dict(a.split("=", 1) for a in argv if "=" in a))
    if len(positional) != 1 or kwargs is None:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if "ema" in kwargs:
            out = ema_model(positional[0], kwargs["out"], kwargs["ema"], kwargs["verify"])
        else:
            out = average(positional[0], **kwargs)
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'the EMA written' if 'ema' in kwargs else 'averaged'} into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

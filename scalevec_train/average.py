"""`python -m scalevec_train.average <run_dir> last=3 out=<dir>` (or steps=[100,200,300]): the mean of
checkpoints of one run as a checkpoint folder that scalevec_train.load and export read
(checkpoint/average.py says what it holds)."""

import sys

from scalevec_train.checkpoint.average import average
from scalevec_train.errors import ScalevecError

USAGE = "usage: python -m scalevec_train.average <run_dir> (last=N | steps=[a,b,...]) out=<folder>"


def parse(options: dict[str, str]) -> dict | None:
    """average()'s keyword arguments from the command line's, or None when they are not usable."""
    if "out" not in options or not options["out"] or len(set(options) - {"out"}) != 1:
        return None
    try:
        if "last" in options:
            return {"out": options["out"], "last": int(options["last"])}
        if "steps" in options:
            steps = [int(s) for s in options["steps"].strip("[]").split(",") if s.strip()]
            return {"out": options["out"], "steps": steps}
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
        out = average(positional[0], **kwargs)
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"averaged into {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

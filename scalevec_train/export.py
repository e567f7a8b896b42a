"""`python -m scalevec_train.export <run_dir or checkpoint> out=<dir>`: a Hugging Face transformers folder
(interop/export.py says what it holds)."""

import sys

from scalevec_train.errors import ScalevecError
from scalevec_train.interop.export import export

USAGE = "usage: python -m scalevec_train.export <run_dir or checkpoints/step_N> out=<folder>"


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    if len(positional) != 1 or set(options) != {"out"} or not options["out"]:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        out = export(positional[0], options["out"])
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

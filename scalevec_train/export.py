"""`python -m scalevec_train.export <run_dir or checkpoint> out=<dir> [verify=false]`: a Hugging Face
transformers folder (interop/export.py says what it holds). `verify=false` reads the checkpoint without
checking it against its checksums first."""

import sys

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.hf_export import export

USAGE = "usage: python -m scalevec_train.export <run_dir or checkpoints/step_N> out=<folder> [verify=false]"


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    verify = options.pop("verify", "true")
    if len(positional) != 1 or set(options) != {"out"} or not options["out"] or verify not in ("true", "false"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        out = export(positional[0], options["out"], verify=verify == "true")
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m scalevec_train.export <run_dir or checkpoint> out=<dir> [verify=false]`: a Hugging
Face transformers folder (interop/hf_export.py says what it holds). `verify=false` reads the
checkpoint without checking it against its checksums first."""

import sys
from dataclasses import dataclass

from scalevec_train.infra.errors import ScalevecError
from scalevec_train.interop.hf_export import export
from scalevec_train.run import cli


@dataclass
class Options:
    path: str = cli.positional("a run directory (its newest complete checkpoint) or one "
                               "checkpoints/step_N")
    out: str = cli.option("the new folder the transformers files are written to")
    verify: bool = cli.option("check the checkpoint against its checksums before reading it", True)

    def __post_init__(self) -> None:
        if not self.out:
            raise ScalevecError("out", "is empty.", "give out=<a new folder>.")


def run(o: Options) -> int:
    print(f"exported to {export(o.path, o.out, verify=o.verify)}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m scalevec_train.describe model=<preset> scale=<preset> [format=json] [world_size=8]
[device_gb=80]`: every scale site of a model under a strategy, every parameter's init, LR, decay,
eps and forward multiplier, what it costs, and the memory each rank needs (costs/tables.py says what
each table holds)."""

import sys
from dataclasses import dataclass

from omegaconf import DictConfig

from scalevec_train.costs.tables import as_json, as_text, report
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.run import cli


@dataclass
class Options:
    format: str = cli.option("table (three tables) or json (one object)", "table")
    world_size: int = cli.option("the GPUs the memory is estimated on", 8)
    device_gb: float = cli.option("the memory of one GPU, in GB (10^9 bytes)", 80.0)

    def __post_init__(self) -> None:
        if self.format not in ("table", "json"):
            raise ScalevecError("format", f"unknown format {self.format!r}.",
                                "use format=table or format=json.")
        if self.world_size < 1 or self.device_gb <= 0:
            raise ScalevecError("world_size/device_gb", f"world_size={self.world_size}, "
                                f"device_gb={self.device_gb:g}.",
                                "give a positive whole world_size and positive device_gb.")


def run(o: Options, raw: DictConfig) -> int:
    d = report(raw, o.world_size, o.device_gb)
    print(as_json(d) if o.format == "json" else as_text(d))
    return 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, run, overrides=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m scalevec_train.describe model=<preset> scale=<preset> [format=json] [world_size=8]
[device_gb=80]`: every scale site of a model under a strategy, every parameter's init, LR, decay, eps and
forward multiplier, what it costs, and the memory each rank needs (costs/tables.py says what each table
holds)."""

import json
import sys

from hydra.errors import HydraException
from omegaconf import OmegaConf

from scalevec_train.config import compose_raw, split_options, to_config
from scalevec_train.costs.tables import (
    describe,
    format_memory,
    format_parameters,
    format_precisions,
    format_table,
    memory,
)
from scalevec_train.infra.errors import ScalevecError


def main(argv: list[str]) -> int:
    options, overrides = split_options(argv, {"format": "table", "world_size": "8", "device_gb": "80"})
    fmt = options["format"]
    try:
        if fmt not in ("table", "json"):
            raise ScalevecError("format", f"unknown format {fmt!r}.", "use format=table or format=json.")
        try:
            world, device_gb = int(options["world_size"]), float(options["device_gb"])
        except ValueError:
            world = device_gb = 0
        if world < 1 or device_gb <= 0:
            raise ScalevecError("world_size/device_gb", f"world_size={options['world_size']}, device_gb="
                                f"{options['device_gb']}.", "give a positive whole world_size and positive device_gb.")
        raw = compose_raw(overrides)
        # the sites and their costs do not depend on the ranks: described as on one process
        d = describe(to_config(OmegaConf.merge(raw, {"distributed": {"expert_parallel": 1}})))
        d["memory"] = memory(raw, world, device_gb)
    except (ScalevecError, HydraException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if fmt == "json":
        d = dict(d, sites=[{k: s[k] for k in ("name", "role", "param", "shape", "behind_norm", "lr", "weight_decay",
                                              "decayed", "magnitude_cancelled_by", "side", "maps", "folds")}
                           for s in d["sites"]])
        print(json.dumps(d))
    else:
        print(format_table(d))
        print()
        print(format_parameters(d))
        print()
        if "fp8" in d:
            print(format_precisions(d), end="\n\n")
        print(format_memory(d["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Expert parallelism with the fused norm+SwiGLU kernel: the companion of
tests/parallel/test_expert_parallel.py for the one composition it leaves out (issue 38), because the
kernel, interpreted on a CPU, costs minutes.

    TRITON_INTERPRET=1 python dev/ep_fused_kernel.py --steps 20

Runs test_expert_parallel's cases with model.kernels=triton on 2 gloo ranks at EP=2 (its machinery,
batches and tolerances): unified with per-expert sites (gate and up normalized, so the experts'
SwiGLU is the fused kernel, called with each rank's rows grouped by its experts) and baseline (the
RMSNorm kernels only), each against one process running the same kernels, every step from the ranks'
parameters. Prints each case's losses once every assertion holds; an assertion error says where it
does not.
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tests.parallel.test_expert_parallel as ep  # noqa: E402

# At import, so that the ranks (forked from a server that imports this module again) have them too.
FUSED = {"fused-unified": ["scale=unified", "scale.per_expert=true", "optim=adamw",
                           "model.kernels=triton"],
         "fused-baseline": ["scale=baseline", "optim=adamw", "model.kernels=triton"]}
ep.CASES.update(FUSED)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=ep.STEPS)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1: on a CPU the kernels run in Triton's interpreter")
    root = ep.launch(Path(tempfile.mkdtemp()) / "two", 2, list(FUSED), steps=args.steps)
    for name in FUSED:
        _, want = ep.check(root, name, 2)
        print(f"{name}: {args.steps} steps as one process does; losses "
              f"{[round(x, 4) for x in want['loss']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

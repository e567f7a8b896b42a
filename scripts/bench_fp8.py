"""FP8 against bf16 per GEMM shape (model.fp8): every distinct block-map shape of the presets given,
at M tokens, forward and backward (y = x W^T, then the gradients of x and W for one output
gradient), compiled, in bf16 (F.linear under bf16 autocast) and through each recipe's FP8 matmul as
training runs it (scalevec_train/parallel/fp8.py), with the recipes whose size filter
(model.fp8_filter=auto) converts it.

    python scripts/bench_fp8.py --presets dense-0.5b,dense-1b,dense-2b --m 16384
    python scripts/bench_fp8.py --presets dense-tiny --m 256 --steps 2 --warmup 1
        --no-compile  # CPU smoke

Each row is printed as soon as its shape is measured (a run stopped at a time limit keeps the rows
it finished). "ms" is the mean wall time of one forward and backward over --steps, the device
synchronized around them; FP8's columns give it and bf16's time over it (the speed-up).
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from scalevec_train.config import compose_config
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.config import FP8_RECIPES
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.fp8 import fp8_matmul, map_precisions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="dense-0.5b,dense-1b,dense-2b",
                   help="model presets, comma-separated")
    p.add_argument("--m", type=int, default=16384,
                   help="tokens per GEMM (micro-batch x sequence length)")
    p.add_argument("--steps", type=int, default=20,
                   help="timed forward-backward passes per variant")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed passes first (compilation happens here)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile each variant's forward (and with it its backward)")
    return p.parse_args(argv)


def shapes(preset: str) -> dict[tuple[int, int], dict]:
    """{(N out, K in): {"maps": the block maps of that shape, "auto": the recipes whose filter
    converts it}}."""
    out: dict[tuple[int, int], dict] = {}
    for recipe in FP8_RECIPES:
        cfg = compose_config([f"model={preset}", f"model.fp8={recipe}"], 1)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.scale)
        for row in map_precisions(model):
            if (not row.name.startswith("layers.0.") or len(row.shape) != 2
                    or ".router." in row.name):
                continue
            entry = out.setdefault(row.shape, {"maps": [], "auto": []})
            name = row.name.removeprefix("layers.0.").removesuffix(".weight").split(".")[-1]
            if name not in entry["maps"]:
                entry["maps"].append(name)
            if row.fp8 and recipe not in entry["auto"]:
                entry["auto"].append(recipe)
    return out


def time_variant(matmul, m: int, n: int, k: int, args: argparse.Namespace,
                 device: torch.device) -> float:
    """Seconds per forward and backward of matmul(x [m, k], W [n, k]) under bf16 autocast (W fp32,
    as one process holds the master weights)."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (torch.randn(n, k, device=device, generator=gen) * 0.02).requires_grad_()
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=gen)

    def forward(x, w):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return matmul(x, w)

    fn = torch.compile(forward) if args.compile else forward
    for _ in range(args.warmup):
        fn(x, w).backward(grad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        fn(x, w).backward(grad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / args.steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        matmuls = {"bf16": F.linear, **{r: fp8_matmul(r, device) for r in FP8_RECIPES}}
        table = {preset: shapes(preset) for preset in args.presets.split(",")}
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"M = {args.m} tokens, forward + backward, {'compiled' if args.compile else 'eager'}, on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (FP8 emulated)'}")
    print("| preset | maps | N x K | bf16 ms | "
          + " | ".join(f"{r} ms (x bf16)" for r in FP8_RECIPES)
          + " | auto converts |")
    print("|" + "---|" * (5 + len(FP8_RECIPES)))
    for preset, found in table.items():
        for (n, k), entry in found.items():
            ms = {name: 1e3 * time_variant(mm, args.m, n, k, args, device)
                  for name, mm in matmuls.items()}
            torch._dynamo.reset()
            fp8 = " | ".join(f"{ms[r]:.3f} (x{ms['bf16'] / ms[r]:.2f})" for r in FP8_RECIPES)
            print(f"| {preset} | {','.join(entry['maps'])} | {n} x {k} | {ms['bf16']:.3f} | {fp8} "
                  f"| {','.join(entry['auto']) or 'none'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

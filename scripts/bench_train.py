"""Training throughput: tokens/s per device, MFU, peak memory and where a step's time goes.

Each (preset, scale) pair is built the way `python -m scalevec_train.train` builds a run (Hydra
composes configs/ with the overrides, then scalevec_train.run.build), warmed up (the warm-up
includes torch.compile), and timed in two phases:
  1. throughput: --steps optimizer steps back to back, the device synchronized before and after;
  2. split: --steps more steps with the device synchronized around data loading and the optimizer
     step. "fwd+bwd" is the rest of the step: forward, backward, host-to-device copies, gradient
     clipping and the loss all-reduce. The extra synchronization makes phase 2 a little slower than
     phase 1.
MFU = tokens/s per device * training FLOPs per token / the device's dense bf16 peak (the FLOPs
formula, attention included, is documented in scalevec_train/costs/accounting.py). Peak memory is
the most GPU memory allocated (torch.cuda.max_memory_allocated) from the first warm-up step to the
end of phase 2: the counter is reset once the run is built (weights initialized, data in place), so
the build itself is left out, and the optimizer state, created by the first step, is counted.
"build s" is the build (data preparation on first use included), "warm-up s" the untimed steps
(compilation included): what a budget for the next run needs. "loss" is the training loss of the
first step and of the last of phase 1 (a run under model.fp8 beside one in bf16: the same data, the
same steps).

    python scripts/bench_train.py --presets dense-0.12b,dense-1b --scales baseline,unified
    python scripts/bench_train.py --presets dense-1b --micro-batch 4 --
        distributed.activation_checkpointing=full
    python scripts/bench_train.py --presets dense-1b --scales baseline,unified -- model.fp8=rowwise
    torchrun --nproc_per_node=8 scripts/bench_train.py --presets dense-1b     # rank 0 prints
    torchrun --nproc_per_node=8 scripts/bench_train.py --presets moe-2b
        --expert-parallel 8   # experts over 8 ranks
    python scripts/bench_train.py --presets dense-tiny --no-compile --seq-len 128 --steps 3
        --warmup 1  # CPU smoke

Arguments after `--` are Hydra overrides for every run. Each row is printed as soon as its pair is
measured, so a run stopped at a time limit keeps the rows it finished.

The data is the real input path of training: the default stdlib corpus through the trainer's loader
(so "data ms" is what training pays), unless overridden. Its tokenizer and shards are prepared on
first use and cached in data_cache/ for later runs: once per machine, about 7 s to train the
32k-piece SentencePiece tokenizer and 19 s to encode 9M tokens in one process on the 2-core CPU
machine (2026-11-25; encoding uses every core, data.num_workers). That happens in the build, before
the first timed step, and never inside a measurement.
"""

import argparse
import gc
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from scalevec_train.config import compose_config
from scalevec_train.costs.accounting import peak_flops, total_params, train_flops_per_token
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.parallel import process_group
from scalevec_train.run.build import build

COLUMNS = ["preset", "scale", "ranks", "EP", "params", "tokens/step", "step ms", "tokens/s/device",
           "MFU", "peak mem GiB", "fwd+bwd ms", "optimizer ms", "data ms", "build s", "warm-up s",
           "loss"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="dense-0.12b,dense-1b",
                   help="model presets, comma-separated")
    p.add_argument("--scales", default="baseline", help="scale strategies, comma-separated")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per rank and step (no gradient accumulation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first (compilation happens here)")
    p.add_argument("--expert-parallel", type=int, default=1,
                   help="ranks each MoE layer's experts are split over "
                        "(distributed.expert_parallel)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile each block (distributed.compile)")
    p.add_argument("--profile", action="store_true",
                   help="then, per pair, the GPU kernels of two more steps by torch.profiler "
                        "(CUDA only)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run (after --)")
    return p.parse_args(argv)


def pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (preset, scale) pairs to measure, in order."""
    return [(p, s) for p in args.presets.split(",") for s in args.scales.split(",")]


def run_overrides(preset: str, scale: str, args: argparse.Namespace, world: int,
                  run_dir: str) -> list[str]:
    """The Hydra overrides of one pair's run (no gradient accumulation: the global batch is one
    micro-batch per rank)."""
    return [f"model={preset}", f"scale={scale}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch={args.micro_batch}",
            f"train.global_batch={args.micro_batch * world}",
            "train.steps=100000", f"distributed.compile={str(args.compile).lower()}",
            f"distributed.expert_parallel={args.expert_parallel}",
            "logger.progress_bar=false", f"run_dir={run_dir}", "resume=none", *args.overrides]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """Wraps a callable and sums its wall time, with the device synchronized on both sides."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.seconds = fn, device, 0.0

    def __call__(self, *args, **kwargs):
        sync(self.device)
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.seconds += time.perf_counter() - start
        return out


@contextmanager
def timed(owner, name: str, device: torch.device) -> Iterator[Timed]:
    """owner.<name> timed by a Timed wrapper while the context lasts. The wrapper is taken off
    again: left on, owner -> Timed -> bound method -> owner is a reference cycle that keeps owner
    (the optimizer: the run's parameters and their state) allocated after the run, until Python's
    cycle collector happens to run, and the next run's peak memory counts it (the eager unified
    dense-1b row of the 2026-11-26 H200 measurements)."""
    wrapper, own = Timed(getattr(owner, name), device), vars(owner).get(name)
    setattr(owner, name, wrapper)
    try:
        yield wrapper
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def bench(preset: str, scale: str, args: argparse.Namespace) -> dict:
    world = process_group.world_size()
    # build() only looks for checkpoints there; nothing is written.
    run_dir = process_group.broadcast_object(tempfile.mkdtemp(prefix="scalevec_bench_")
                                             if process_group.is_main() else None)
    cfg = compose_config(run_overrides(preset, scale, args, world, run_dir), world)
    row = {"preset": preset, "scale": scale, "ranks": world, "EP": args.expert_parallel}
    device = None
    try:
        start = time.perf_counter()
        trainer = build(cfg).trainer
        device = trainer.compute.device
        sync(device)
        row["build s"] = f"{time.perf_counter() - start:.1f}"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row["params"] = f"{total_params(trainer.model) / 1e6:.1f}M"
        tokens = cfg.train.global_batch * cfg.train.seq_len
        row["tokens/step"] = tokens
        start = time.perf_counter()
        first = [trainer.train_step().loss for _ in range(args.warmup)]
        sync(device)
        row["warm-up s"] = f"{time.perf_counter() - start:.1f}"


        start = time.perf_counter()
        for _ in range(args.steps):
            last = trainer.train_step().loss
        sync(device)
        step_s = (time.perf_counter() - start) / args.steps
        row["loss"] = f"{(first or [last])[0].item():.3f} -> {last.item():.3f}"
        per_device = tokens / step_s / world
        row["step ms"] = f"{step_s * 1e3:.1f}"
        row["tokens/s/device"] = f"{per_device:,.0f}"
        peak = peak_flops(device)
        if peak:
            flops = per_device * train_flops_per_token(trainer.model, cfg.train.seq_len)
            row["MFU"] = f"{100 * flops / peak:.1f}%"

        with (timed(trainer.loader, "next_batch", device) as data,
              timed(trainer.optimizer, "step", device) as optim):
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            sync(device)
            total = time.perf_counter() - start
        row["fwd+bwd ms"] = f"{(total - data.seconds - optim.seconds) / args.steps * 1e3:.1f}"
        row["optimizer ms"] = f"{optim.seconds / args.steps * 1e3:.1f}"
        row["data ms"] = f"{data.seconds / args.steps * 1e3:.1f}"
        if args.profile and device.type == "cuda":
            row["kernels"] = profile_steps(trainer, 2)
    except torch.cuda.OutOfMemoryError:
        row["step ms"] = "out of memory"
    finally:
        if device is not None and device.type == "cuda":
            row["peak mem GiB"] = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}"
        trainer = None
        if process_group.is_main():
            shutil.rmtree(run_dir, ignore_errors=True)
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def profile_steps(trainer, steps: int) -> list[tuple[str, float]]:
    """The GPU kernels of `steps` training steps by torch.profiler: (name, device ms per step),
    longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / steps / 1e3) for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(kernels, key=lambda kv: -kv[1])


def print_profile(row: dict, top: int = 20) -> None:
    kernels = row["kernels"]
    total = sum(ms for _, ms in kernels)
    print(f"\n{row['preset']} {row['scale']}: {total:.1f} ms of GPU kernels per step, the {top} "
          f"longest ({len(kernels)} kernels in all):\n\n"
          "| kernel | ms per step | share |\n|---|---|---|")
    for name, ms in kernels[:top]:
        print(f"| {name[:90]} | {ms:.2f} | {100 * ms / max(total, 1e-9):.1f}% |")


def table_row(row: dict) -> str:
    return "| " + " | ".join(str(row.get(c, "-")) for c in COLUMNS) + " |"


def main() -> None:
    args = parse_args()
    process_group.init()
    try:
        main_rank = process_group.is_main()
        if main_rank:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
            print(f"{device}, torch {torch.__version__}, {process_group.world_size()} rank(s), "
                  f"seq_len {args.seq_len}, micro-batch {args.micro_batch}, compile "
                  f"{args.compile}, overrides {args.overrides or 'none'}")
            print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
        rows = []
        for preset, scale in pairs(args):
            rows.append(bench(preset, scale, args))
            if main_rank:
                print(table_row(rows[-1]), flush=True)
        for row in rows:
            if main_rank and "kernels" in row:
                print_profile(row)
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        process_group.shutdown()


if __name__ == "__main__":
    main()

"""Eager against compiled on one machine, in one run: the unified/baseline step-time ratio of a
preset with the blocks eager and compiled (distributed.compile), and the loss (cross-entropy on fp32
logits, forward and backward) eager and compiled, next to the step it belongs to.

    python scripts/bench_compile.py --preset dense-study  # the study's 16 x 128 tokens
    python scripts/bench_compile.py --preset dense-study -- data.cache_dir=/tmp/data_cache

Each step time is scripts/bench_train.py's (the run built as training builds it, warmed up with the
compilation, then --steps steps timed); baseline and unified run back to back in each mode, so that
a shared machine's drift touches the two of a ratio alike.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import bench  # noqa: E402

from scalevec_train.config import compose_config  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dense-study", help="model preset")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps first (compilation happens here)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run (after --)")
    return p.parse_args()


def loss_ms(logits: torch.Tensor, targets: torch.Tensor, fn, repeats: int = 10) -> float:
    """Forward and backward of fn(logits, targets), per call, after two untimed calls."""
    for i in range(repeats + 2):
        if i == 2:
            start = time.perf_counter()
        leaf = logits.detach().requires_grad_()
        fn(leaf, targets).backward()
    return (time.perf_counter() - start) / repeats * 1e3


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def main() -> None:
    args = parse_args()
    steps = {}
    for compiled in (False, True):
        for scale in ("baseline", "unified"):
            run = argparse.Namespace(seq_len=args.seq_len, micro_batch=args.micro_batch,
                                     steps=args.steps, warmup=args.warmup, compile=compiled,
                                     overrides=args.overrides)
            steps[compiled, scale] = float(bench(args.preset, scale, run)["step ms"])
    vocab = compose_config([f"model={args.preset}", *args.overrides], 1).model.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.micro_batch, args.seq_len, vocab, generator=gen)
    targets = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen)
    losses = {False: loss_ms(logits, targets, cross_entropy),
              True: loss_ms(logits, targets, torch.compile(cross_entropy, fullgraph=True))}

    print(f"{args.preset}, {args.micro_batch} x {args.seq_len} tokens per step, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{'CUDA' if torch.cuda.is_available() else 'CPU'}")
    print("| blocks | baseline step ms | unified step ms | unified / baseline | loss fwd+bwd ms "
          "| loss share of baseline step |")
    print("|---|---|---|---|---|---|")
    for compiled in (False, True):
        base, unified = steps[compiled, "baseline"], steps[compiled, "unified"]
        print(f"| {'compiled' if compiled else 'eager'} | {base:.1f} | "
              f"{unified:.1f} | {unified / base:.2f} | {losses[compiled]:.1f} | "
              f"{100 * losses[compiled] / base:.1f}% |")


if __name__ == "__main__":
    main()

"""Benchmark the fused RMSNorm+scale kernels (issue 7) on a CUDA device.

For each shape (M tokens, N features, K scaled outputs, bf16) it times forward and backward of
  fused     scalevec_kernels.rms_norm_scales(backend="triton"): one read of x for K outputs
  eager     K calls of F.rms_norm(x, (N,), s_k) (a stock norm per branch)
  compile   torch.compile of the plain PyTorch reference (N(x) once, K products)
  liger     K calls of Liger-Kernel's LigerRMSNorm, when liger_kernel is installed
and reports bandwidth by the byte model of the fused kernel (forward M((1+K)Nb + 4) bytes, backward
M((K+2)Nb + 4) plus its fp32 partials written and read), as a share of the device's measured copy
bandwidth; "x floor" is the time over the byte-model floor (bytes / copy bandwidth). The same byte
count is used for every implementation, so the columns compare times.

    python scripts/bench_kernels.py [--m 8192 16384 32768] [--n 768 1024 2048 4096] [--k 1 2 3]

Prints a markdown table (with device, versions and date) to paste into docs/benchmarks.md, then the
issue's targets that the fused kernels miss.
"""

import argparse
import datetime
import importlib.util

import torch
import torch.nn.functional as F

from scalevec_kernels import rms_norm_scales, rms_norm_scales_reference
from scalevec_kernels.rms_norm import backward_chunks

EPS = 1e-6
DTYPE = torch.bfloat16


def bench_ms(fn) -> float:
    """Median time of fn in ms (triton's do_bench: warm-up, L2 flushed before every run)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = bench_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() / seconds


# Each implementation is built per shape from the K scale parameters and maps x to the K outputs.
def fused(scales):
    return lambda x: rms_norm_scales(x, scales, EPS, backend="triton")


def eager(scales):
    return lambda x: tuple(F.rms_norm(x, (x.shape[-1],), s, EPS) for s in scales)


def compiled_reference(scales):
    return torch.compile(lambda x: rms_norm_scales_reference(x, scales, EPS), dynamic=False)


def liger(scales):
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    norms = []
    for s in scales:
        norm = LigerRMSNorm(s.numel(), eps=EPS)
        norm.weight = s
        norms.append(norm)
    return lambda x: tuple(norm(x) for norm in norms)


def implementations() -> dict:
    impls = {"fused": fused, "eager": eager, "compile": compiled_reference}
    if importlib.util.find_spec("liger_kernel") is not None:
        impls["liger"] = liger
    return impls


def time_impl(make, m: int, n: int, k: int) -> tuple[float, float]:
    """(forward ms, backward ms) of one implementation; backward replays the same autograd graph."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=DTYPE, generator=gen).requires_grad_()
    scales = [torch.nn.Parameter(1 + 0.1 * torch.randn(n, device="cuda", dtype=DTYPE, generator=gen))
              for _ in range(k)]
    fn = make(scales)
    with torch.no_grad():
        fn(x)  # compiles where there is something to compile, outside the timing
        fwd = bench_ms(lambda: fn(x))
    outs = fn(x)
    upstream = [torch.randn_like(o) for o in outs]
    bwd = bench_ms(lambda: torch.autograd.grad(outs, [x, *scales], upstream, retain_graph=True))
    return fwd, bwd


def byte_model(m: int, n: int, k: int) -> tuple[int, int]:
    """(forward bytes, backward bytes) of the fused kernels."""
    b = torch.finfo(DTYPE).bits // 8
    partials = 2 * backward_chunks(n, m, 1, torch.device("cuda")) * k * n * 4
    return m * ((1 + k) * n * b + 4), m * ((k + 2) * n * b + 4) + partials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[8192, 16384, 32768], help="token counts M")
    parser.add_argument("--n", type=int, nargs="+", default=[768, 1024, 2048, 4096], help="feature sizes N")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="scaled outputs K")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA device.")

    import triton

    copy_bw = copy_bandwidth()
    impls = implementations()
    print(f"Device: {torch.cuda.get_device_name()}; date {datetime.date.today()}; torch {torch.__version__}, "
          f"triton {triton.__version__}; bf16; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s.\n")
    print("| M | N | K | pass | impl | time (us) | GB/s | % copy | x floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    misses = []
    for m in args.m:
        for n in args.n:
            for k in args.k:
                torch._dynamo.reset()  # one compiled graph per shape, never a recompile limit
                times = {name: time_impl(make, m, n, k) for name, make in impls.items()}
                for p, (label, nbytes) in enumerate(zip(("fwd", "bwd"), byte_model(m, n, k), strict=True)):
                    for name, t in times.items():
                        ms = t[p]
                        share = nbytes / (ms / 1e3) / copy_bw
                        print(f"| {m} | {n} | {k} | {label} | {name} | {ms * 1e3:.1f} | "
                              f"{nbytes / (ms / 1e3) / 1e9:.0f} | {100 * share:.1f} | {1 / share:.2f} |")
                    misses += _missed_targets(m, n, k, label, nbytes, times, p, copy_bw)
    print("\nTargets missed (issue 7: fwd >= 90% / bwd >= 80% of copy for N >= 1024; faster than every other "
          "implementation; K = 3 within 1.1x of the floor):")
    print("\n".join(f"- {line}" for line in misses) if misses else "- none")


def _missed_targets(m, n, k, label, nbytes, times, p, copy_bw) -> list[str]:
    shape = f"M={m} N={n} K={k} {label}"
    ms = times["fused"][p]
    share = nbytes / (ms / 1e3) / copy_bw
    out = []
    if n >= 1024 and share < (0.9 if label == "fwd" else 0.8):
        out.append(f"{shape}: {100 * share:.1f}% of copy bandwidth")
    slower = [name for name, t in times.items() if name != "fused" and t[p] <= ms]
    if slower:
        out.append(f"{shape}: not faster than {', '.join(slower)}")
    if k == 3 and 1 / share > 1.1:
        out.append(f"{shape}: {1 / share:.2f}x its byte-model floor")
    return out


if __name__ == "__main__":
    main()

"""Benchmark the fused kernels on a CUDA device: RMSNorm+scale (issue 7) and normalization + SwiGLU.

rms_norm: for each shape (M tokens, N features, K scaled outputs, bf16) it times forward and
backward of
  fused     scalevec_kernels.rms_norm_scales(backend="triton"): one read of x for K outputs
  eager     K calls of F.rms_norm(x, (N,), s_k) (a stock norm per branch)
  compile   torch.compile of the plain PyTorch reference (N(x) once, K products)
  liger     K calls of Liger-Kernel's LigerRMSNorm, when liger_kernel is installed
(--against picks the implementations timed beside fused.) Every implementation runs one untimed
forward and backward first (compilation, autotuning, Triton's JIT), then do_bench warms up before it
times. The compiled reference is dynamic in M: one graph (and one compilation) per (N, K) serves
every M; the compile cache is cleared between (N, K) groups so that no group meets dynamo's
recompile limit.
and reports bandwidth by the byte model of the fused kernel (forward M((1+K)Nb + 4) bytes, backward
M((K+2)Nb + 4) plus its fp32 partials written and read), as a share of the device's measured copy
bandwidth; "x floor" is the time over the byte-model floor (bytes / copy bandwidth). The same byte
count is used for every implementation, so the columns compare times.

swiglu_norm: for each shape (M rows, F hidden features, bf16 gate/up, fp32 scales shared by every
row or per expert over E equal groups of rows) it times silu(u_g * N(G)) * (u_u * N(U)) as
  fused     scalevec_kernels.swiglu_norm(backend="triton"): one read of G and U, one write
  eager     scalevec_kernels.swiglu_norm_reference (the model's unfused path)
  compile   torch.compile of that reference
with the byte model forward M(3Fb + 8), backward M(5Fb + 8) plus the partials of both scale
gradients (scale reads left out).

    python scripts/bench_kernels.py [--ops rms_norm swiglu_norm] [--against eager compile liger]
        [--m 8192 16384 32768] [--n 768 1024 2048 4096] [--k 1 2 3] [--f 1024 2304 4096 8192]
        [--experts 0 8]

Prints markdown tables (with device, versions and date) to paste into
docs/benchmarks/<date>-<device>.md, then the issue's targets that the fused RMSNorm kernels miss and
the shapes where fused SwiGLU is not the fastest.
"""

import argparse
import datetime
import importlib.util
import sys
import time

import torch
import torch.nn.functional as F

from scalevec_kernels import (
    rms_norm_scales,
    rms_norm_scales_reference,
    swiglu_norm,
    swiglu_norm_reference,
)
from scalevec_kernels.rms_norm import backward_grid
from scalevec_kernels.swiglu_norm import backward_grid as swiglu_backward_grid

EPS = 1e-6
DTYPE = torch.bfloat16


def bench_ms(fn) -> float:
    """Median time of fn in ms (triton's do_bench: 25 ms of warm-up runs, then about 100 ms of timed
    runs, the L2 flushed before each; at least ~100 runs for the largest shapes here)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


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


RMS_IMPLS = {"fused": fused, "eager": eager, "compile": compiled_reference, "liger": liger}


def profile_call(fn, calls: int = 20) -> tuple[float, float, list[tuple[str, float]]]:
    """(host us, device us, [(kernel, device us)]) per call of fn. Host: the time to issue one call,
    the device synchronized only around a batch of calls (when it is close to the wall time, the
    host is the bottleneck). Device: the GPU time of the call's kernels, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.self_device_time_total / calls) for e in prof.key_averages()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda kv: -kv[1])
    return host, sum(us for _, us in kernels), kernels


def time_fwd_bwd(fn, inputs: list[torch.Tensor], leaves: list[torch.Tensor],
                 profiled: list | None = None) -> tuple[float, float]:
    """(forward ms, backward ms) of fn(*inputs); backward replays the same autograd graph into
    `leaves`. Each pass runs once untimed first: whatever it compiles (the forward graph, the
    backward graph, the Triton kernels) is compiled outside the timing. With `profiled`, each pass's
    profile_call is appended to it."""
    with torch.no_grad():
        fn(*inputs)
        fwd = bench_ms(lambda: fn(*inputs))
        if profiled is not None:
            profiled.append(profile_call(lambda: fn(*inputs)))
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = [torch.randn_like(o) for o in outs]

    def backward():
        return torch.autograd.grad(outs, leaves, upstream, retain_graph=True)

    backward()
    bwd = bench_ms(backward)
    if profiled is not None:
        profiled.append(profile_call(backward))
    return fwd, bwd


def time_impl(make, m: int, n: int, k: int, profiled: list | None = None) -> tuple[float, float]:
    """(forward ms, backward ms) of one RMSNorm implementation."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=DTYPE, generator=gen).requires_grad_()
    torch._dynamo.maybe_mark_dynamic(x, 0)  # the compiled reference: one graph for every M
    scales = [torch.nn.Parameter(1 + 0.1 * torch.randn(n, device="cuda", dtype=DTYPE,
                                                       generator=gen))
              for _ in range(k)]
    return time_fwd_bwd(make(scales), [x], [x, *scales], profiled)


def byte_model(m: int, n: int, k: int) -> tuple[int, int]:
    """(forward bytes, backward bytes) of the fused kernels."""
    b = torch.finfo(DTYPE).bits // 8
    partials = 2 * backward_grid(n, m, 1, (k + 1) * b, (k + 2) * b, False,
                                 torch.device("cuda"))[3] * k * n * 4
    return m * ((1 + k) * n * b + 4), m * ((k + 2) * n * b + 4) + partials


# SwiGLU implementations, built per shape from the expert offsets (None: shared scales); each maps
# (gate, up, gate_scale, up_scale) to the output.
def swiglu_fused(offsets):
    return lambda *t: swiglu_norm(*t, EPS, offsets, backend="triton")


def swiglu_eager(offsets):
    return lambda *t: swiglu_norm_reference(*t, EPS, offsets)


def swiglu_compiled(offsets):
    return torch.compile(swiglu_eager(offsets), dynamic=False)


SWIGLU_IMPLS = {"fused": swiglu_fused, "eager": swiglu_eager, "compile": swiglu_compiled}


def time_swiglu(make, m: int, f: int, experts: int,
                profiled: list | None = None) -> tuple[float, float]:
    """(forward ms, backward ms) of one SwiGLU implementation; experts = 0: scales shared by every
    row."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate, up = (torch.randn(m, f, device="cuda", dtype=DTYPE, generator=gen).requires_grad_()
                for _ in range(2))
    for t in (gate, up):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    shape = (experts, f) if experts else (f,)
    scales = [torch.nn.Parameter(1 + 0.1 * torch.randn(shape, device="cuda", generator=gen))
              for _ in range(2)]
    offsets = torch.arange(1, experts + 1, device="cuda") * m // experts if experts else None
    return time_fwd_bwd(make(offsets), [gate, up, *scales], [gate, up, *scales], profiled)


def swiglu_byte_model(m: int, f: int, experts: int) -> tuple[int, int]:
    """(forward bytes, backward bytes) of the fused SwiGLU kernels."""
    b = torch.finfo(DTYPE).bits // 8
    groups = max(1, experts)
    partials = 2 * 2 * swiglu_backward_grid(f, m, groups, 3 * b, 5 * b,
                                            torch.device("cuda"))[3] * groups * f * 4
    return m * (3 * f * b + 8), m * (5 * f * b + 8) + partials


def _measured(args, shape: dict, m: int, times: dict, device: dict) -> None:
    """Keep the fused and compiled forward + backward of a shape for --table: GPU kernel time
    (torch.profiler) with --profile, else wall time; at the largest M only (the table has one row
    count)."""
    if args.table is None or "compile" not in times or m != max(args.m):
        return
    kind = "device" if args.profile else "wall"
    us = {name: round(device[name] if args.profile else sum(times[name]) * 1e3, 1)
          for name in ("fused", "compile")}
    MEASURED.append({**shape, **us, "time": kind})


# The rows --table writes (scalevec_kernels/measured/ holds them for model.kernels=auto)
MEASURED: list[dict] = []


def _row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def _rows(shape: list, byte_model: tuple[int, int], times: dict, copy_bw: float) -> list[str]:
    """One table row per pass and implementation: time, bandwidth by the byte model, share of copy,
    x floor."""
    out = []
    for p, (label, nbytes) in enumerate(zip(("fwd", "bwd"), byte_model, strict=True)):
        for name, t in times.items():
            share = nbytes / (t[p] / 1e3) / copy_bw
            out.append(_row([*shape, label, name, f"{t[p] * 1e3:.1f}",
                             f"{nbytes / (t[p] / 1e3) / 1e9:.0f}",
                             f"{100 * share:.1f}", f"{1 / share:.2f}"]))
    return out


def _profile_rows(shape: list, impl: str, times: tuple[float, float],
                  profiled: list | None) -> list[str]:
    """One row per pass of a --profile table: wall time, host time to issue the call, GPU kernel
    time of its kernels, and the kernels (longest first)."""
    if profiled is None:
        return []
    out = []
    for label, wall, (host, device, kernels) in zip(("fwd", "bwd"), times, profiled, strict=True):
        names = "; ".join(f"{name[:48]} {us:.1f}" for name, us in kernels[:4])
        out.append(_row([*shape, label, impl, f"{wall * 1e3:.1f}", f"{host:.1f}", f"{device:.1f}",
                         names]))
    return out


def _print_profiles(shape_columns: list[str], rows: list[str]) -> None:
    if rows:
        print("\nProfile (us per call; host: issuing the call, device: its kernels by "
              "torch.profiler):\n")
        print(_row([*shape_columns, "pass", "impl", "wall", "host", "device",
                    "kernels (device us)"]))
        print("|---" * (len(shape_columns) + 6) + "|")
        print("\n".join(rows), flush=True)


def bench_rms_norm(args, copy_bw: float) -> None:
    impls = {name: RMS_IMPLS[name] for name in ("fused", *args.against)}
    print("| M | N | K | pass | impl | time (us) | GB/s | % copy | x floor |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    misses, profiles = [], []
    for n in args.n:
        for k in args.k:
            torch._dynamo.reset()  # one group's graphs at a time: never dynamo's recompile limit
            for m in args.m:
                times, device = {}, {}
                for name, make in impls.items():
                    profiled = [] if args.profile else None
                    times[name] = time_impl(make, m, n, k, profiled)
                    profiles += _profile_rows([m, n, k], name, times[name], profiled)
                    device[name] = profiled and sum(p[1] for p in profiled)
                _measured(args, {"op": "rms_norm", "n": n, "k": k}, m, times, device)
                print("\n".join(_rows([m, n, k], byte_model(m, n, k), times, copy_bw)), flush=True)
                for p, (label, nbytes) in enumerate(zip(("fwd", "bwd"), byte_model(m, n, k),
                                                        strict=True)):
                    misses += _missed_targets(m, n, k, label, nbytes, times, p, copy_bw)
    print(f"\nTargets missed (issue 7: fwd >= 90% / bwd >= 80% of copy for N >= 1024; faster than "
          f"{', '.join(args.against)}; K = 3 within 1.1x of the floor):")
    print("\n".join(f"- {line}" for line in misses) if misses else "- none")
    _print_profiles(["M", "N", "K"], profiles)


def bench_swiglu_norm(args, copy_bw: float) -> None:
    impls = {name: make for name, make in SWIGLU_IMPLS.items()
             if name == "fused" or name in args.against}
    print("| M | F | scales | pass | impl | time (us) | GB/s | % copy | x floor |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    slower, profiles = [], []
    for f in args.f:
        for experts in args.experts:
            torch._dynamo.reset()
            for m in args.m:
                scales = f"{experts} experts" if experts else "shared"
                times, device = {}, {}
                for name, make in impls.items():
                    profiled = [] if args.profile else None
                    times[name] = time_swiglu(make, m, f, experts, profiled)
                    profiles += _profile_rows([m, f, scales], name, times[name], profiled)
                    device[name] = profiled and sum(p[1] for p in profiled)
                _measured(args, {"op": "swiglu_norm", "n": f, "experts": experts}, m, times, device)
                print("\n".join(_rows([m, f, scales], swiglu_byte_model(m, f, experts), times,
                                      copy_bw)),
                      flush=True)
                for p, label in enumerate(("fwd", "bwd")):
                    faster = [name for name, t in times.items()
                              if name != "fused" and t[p] <= times["fused"][p]]
                    if faster:
                        slower.append(f"M={m} F={f} {scales} {label}: not faster than "
                                      f"{', '.join(faster)}")
    print("\nShapes where fused SwiGLU is not the fastest:")
    print("\n".join(f"- {line}" for line in slower) if slower else "- none")
    _print_profiles(["M", "F", "scales"], profiles)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", choices=("rms_norm", "swiglu_norm"),
                        default=["rms_norm", "swiglu_norm"],
                        help="which fused kernels to benchmark")
    parser.add_argument("--against", nargs="+", choices=tuple(RMS_IMPLS)[1:],
                        help="implementations timed beside fused (swiglu_norm has no liger); "
                             "default: eager, compile, and liger where liger_kernel is installed")
    parser.add_argument("--m", type=int, nargs="+", default=[8192, 16384, 32768],
                        help="token (row) counts M")
    parser.add_argument("--n", type=int, nargs="+", default=[768, 1024, 2048, 4096],
                        help="rms_norm: feature sizes N")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3],
                        help="rms_norm: scaled outputs K")
    parser.add_argument("--f", type=int, nargs="+", default=[1024, 2304, 4096, 8192],
                        help="swiglu_norm: hidden widths F")
    parser.add_argument("--experts", type=int, nargs="+", default=[0, 8],
                        help="swiglu_norm: experts E of per-expert scales (0: scales shared "
                             "by every row)")
    parser.add_argument("--profile", action="store_true",
                        help="also a table per op of host and GPU kernel time per call, and "
                             "the kernels run")
    parser.add_argument("--table", metavar="PATH",
                        help="write the fused and compiled times (forward + backward, "
                             "at the largest M; GPU time with --profile) as the "
                             "JSON that model.kernels=auto reads: commit it as "
                             "kernels/scalevec_kernels/measured/<date>-<device>.json")
    args = parser.parse_args(argv)
    has_liger = importlib.util.find_spec("liger_kernel") is not None
    if args.against is None:
        args.against = ["eager", "compile", *(["liger"] if has_liger else [])]
    elif "liger" in args.against and not has_liger:
        parser.error("--against liger needs Liger-Kernel: pip install liger-kernel")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA device.")

    import torch._functorch.config as functorch_config
    import triton

    # The backward is timed by replaying one autograd graph (retain_graph=True), which a compiled
    # backward refuses when it donates its saved buffers to the gradients.
    functorch_config.donated_buffer = False
    copy_bw = copy_bandwidth()
    print(f"Device: {torch.cuda.get_device_name()}; date {datetime.date.today()}; "
          f"torch {torch.__version__}, triton {triton.__version__}; bf16; measured copy bandwidth "
          f"{copy_bw / 1e9:.0f} GB/s.\n")
    if "rms_norm" in args.ops:
        bench_rms_norm(args, copy_bw)
    if "swiglu_norm" in args.ops:
        if "rms_norm" in args.ops:
            print()
        bench_swiglu_norm(args, copy_bw)
    if args.table:
        _write_table(args)


def _write_table(args) -> None:
    import json
    import subprocess

    import triton

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    table = {"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
             "torch": torch.__version__,
             "triton": triton.__version__, "kernels": f"commit {commit or 'unknown'}",
             "source": f"scripts/bench_kernels.py {' '.join(sys.argv[1:])}", "rows": max(args.m),
             "dtype": "bf16", "us": "forward + backward, microseconds per call",
             "measurements": MEASURED}
    with open(args.table, "w") as f:
        json.dump(table, f, indent=1)
    print(f"\nwrote {len(MEASURED)} measurements to {args.table}")


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

"""The Triton kernels the model presets launch, compiled ahead of time (no GPU needed): one row per
distinct launch variant with its tile, warps, registers, spills, shared memory and occupancy.

The launches come from the real launch code: every preset of configs/model is built (one layer, a
small vocabulary: neither changes a kernel launch) with model.kernels=triton under each strategy that
changes the launches, and run forward and backward on a few tokens in fp32 and under bf16 autocast
inside scalevec_kernels.aot.capture, which records each launch instead of running it. Presets with the
same widths launch the same variants and run once. Each distinct variant is then compiled with the
local venv's Triton for sm_80 and sm_90 (scalevec_kernels.aot.compile_variant). Beside the presets,
LIMITS lists the widest calls the kernel library takes (not launched by any preset).

    python scripts/kernel_table.py [--cc 80 90] [--presets dense-1b moe-2b]

Prints a markdown table for docs/benchmarks.md ("Kernels compiled, not yet timed") and exits 1 when a
preset's variant spills or needs more shared memory than a block may have.
"""

import argparse
import contextlib
import datetime
import sys
from pathlib import Path

import torch

from scalevec_kernels import aot, rms_norm_scales, swiglu_norm
from scalevec_train.config import compose_config
from scalevec_train.errors import ScalevecError
from scalevec_train.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml"))
# The strategies whose kernel launches differ (K outputs and scaled slots, residual, per-head and output
# norms, per-expert scales); or/er/iwd/wd_all launch what baseline or unified launch.
STRATEGIES = {
    "baseline": ["scale=baseline"],
    "none": ["scale=none"],
    "hg": ["scale=hg"],
    "dp": ["scale=dp"],
    "dnp": ["scale=dnp"],
    "unified": ["scale=unified"],
    "unified-full-heads": ["scale=unified", "scale.head_site_shape=full"],
    "unified-rev1": ["scale=unified", "scale.targets=[q,k,o,down]"],
    "unified-per-expert": ["scale=unified", "scale.per_expert=true"],
}
CHEAP = ["model.n_layers=1", "model.vocab_size=128", "model.kernels=triton"]
TOKENS = 16
# The widest calls the library takes, in bf16 and fp32: K = 4 outputs with a residual, and SwiGLU.
LIMIT_WIDTHS = (8192, 16384)


def _shape(cfg) -> tuple:
    """What decides a preset's launches: every model option but its name and those CHEAP overrides."""
    skip = {"name", "n_layers", "vocab_size", "max_seq_len", "rope_theta", "kernels"}
    return tuple((k, repr(v)) for k, v in sorted(vars(cfg.model).items()) if k not in skip)


def _build(preset: str, overrides: list[str]) -> Transformer | None:
    """The preset's model under a strategy; None for a combination the framework refuses (e.g. dp on a
    preset with QK-norm)."""
    try:
        cfg = compose_config([f"model={preset}", *overrides, *CHEAP], 1)
        return Transformer(cfg.model, cfg.scale)
    except ScalevecError:
        return None


def _run_model(model: Transformer) -> None:
    model.init_weights(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    for autocast in (contextlib.nullcontext, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        with autocast():
            logits = model(tokens)
            aux = model.auxiliary_loss()
        loss = logits.float().sum() + (0 if aux is None else aux)
        loss.backward()
        model.zero_grad(set_to_none=True)


def preset_launches(presets=PRESETS) -> dict[aot.Variant, list[str]]:
    """Every distinct variant the presets launch, with the presets (and strategies) that launch it."""
    users: dict[aot.Variant, list[str]] = {}
    done: dict[tuple, list[aot.Variant]] = {}
    for preset in presets:
        for strategy, overrides in STRATEGIES.items():
            cfg = compose_config([f"model={preset}", *CHEAP], 1)
            if strategy == "unified-per-expert" and cfg.model.moe is None:
                continue
            key = (_shape(cfg), strategy)
            if key not in done:
                model = _build(preset, overrides)
                done[key] = []
                if model is not None:
                    with aot.capture() as launches:
                        _run_model(model)
                    done[key] = launches.variants
            for variant in done[key]:
                users.setdefault(variant, [])
                if preset not in users[variant]:
                    users[variant].append(preset)
    return users


def limit_launches() -> list[aot.Variant]:
    """The widest calls the kernel library takes (not launched by a preset)."""
    with aot.capture() as launches:
        for n in LIMIT_WIDTHS:
            for dtype in (torch.bfloat16, torch.float32):
                x, r = (torch.randn(TOKENS, n, dtype=dtype, requires_grad=True) for _ in range(2))
                scales = [torch.ones(n, requires_grad=True) for _ in range(4)]
                outs = rms_norm_scales(x, scales, 1e-6, residual=r, backend="triton")
                torch.autograd.grad(outs, [x, r, *scales], [torch.ones_like(o) for o in outs])
                out = swiglu_norm(x, r, scales[0], scales[1], 1e-6, backend="triton")
                torch.autograd.grad(out, [x, r, scales[0], scales[1]], torch.ones_like(out))
    return launches.variants


def describe(variant: aot.Variant) -> tuple[str, str, str]:
    """(kernel, tile, what it computes) of a variant, for the table."""
    module, name = variant.kernel.split(".")
    c = dict(variant.constexprs)
    direction = "bwd" if "bwd" in name else "fwd"
    tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}" + (" chunked" if c.get("CHUNKED") else "")
    x = variant.dtype("X" if module == "rms_norm" else "G")
    if module == "rms_norm":
        flags = [f"K={c['K']}", f"scaled={c['SCALED']}"]
        flags += ["residual"] * bool(c.get("HAS_RES") or c.get("HAS_DH"))
        scale = variant.dtype("S0") if c["SCALED"] else None
    else:
        flags = [f"scaled={c['SCALED']}", f"per_expert={c['PER_EXPERT']}"]
        scale = variant.dtype("SG") if c["SCALED"] & 1 else variant.dtype("SU") if c["SCALED"] else None
    what = f"{x}" + (f", {scale} scales" if scale else "") + ", " + ", ".join(flags)
    return f"{module} {direction}", tile, what


def compile_all(variants, ccs) -> dict[tuple[aot.Variant, int], aot.Usage]:
    return {(v, cc): aot.compile_variant(v, cc) for v in variants for cc in ccs}


def table(rows, usage, ccs) -> list[str]:
    head = ["kernel", "tile", "warps", "variant"] + [f"{col} sm_{cc}" for cc in ccs
                                                     for col in ("regs", "spill B", "smem KB", "occupancy")]
    lines = ["| " + " | ".join(head + ["launched by"]) + " |", "|" + "---|" * (len(head) + 1)]
    for variant, users in rows:
        kernel, tile, what = describe(variant)
        cells = [kernel, tile, str(variant.num_warps), what]
        for cc in ccs:
            u = usage[variant, cc]
            cells += [str(u.registers), str(u.spill_bytes), f"{u.shared_bytes / 1024:.1f}",
                      f"{u.occupancy(variant.num_warps):.0%}"]
        lines.append("| " + " | ".join(cells + [users]) + " |")
    return lines


def _summary(presets: list[str]) -> str:
    return ", ".join(presets) if len(presets) <= 4 else f"{len(presets)} presets ({presets[0]}, ...)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cc", type=int, nargs="+", default=[80, 90], choices=sorted(aot.SHARED_PER_BLOCK))
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    args = parser.parse_args(argv)
    import triton

    users = preset_launches(args.presets)
    limits = [v for v in limit_launches() if v not in users]
    usage = compile_all(list(users) + limits, args.cc)
    order = sorted(users, key=lambda v: (describe(v), v.num_warps))
    rows = [(v, _summary(users[v])) for v in order] + [(v, "library limit") for v in limits]
    print(f"Triton {triton.__version__}, compiled for {', '.join(f'sm_{cc}' for cc in args.cc)}, "
          f"{datetime.date.today()}: {len(users)} variants launched by {len(args.presets)} presets, "
          f"{len(limits)} more at the library's limits.\n")
    print("\n".join(table(rows, usage, args.cc)))
    bad = [(describe(v), p) for v in users for cc in args.cc for p in usage[v, cc].problems()]
    for what, problem in bad:
        print(f"FAIL {' '.join(what)}: {problem}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

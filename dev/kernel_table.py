"""The Triton kernels the model presets launch, compiled ahead of time (no GPU needed): one row per
distinct launch variant with its tile, warps, registers, spills, shared memory and occupancy.

The launches come from the real launch code: every preset of configs/model is built (one layer, a
small vocabulary: neither changes a kernel launch) with model.kernels=triton under each strategy
that changes the launches, and run forward and backward on a few tokens in fp32 and under bf16
autocast inside kernel_tools.aot.capture, which records each launch instead of running it. Presets
with the same widths launch the same variants and run once. Each distinct variant is then compiled
with the local venv's Triton for sm_80 and sm_90 (kernel_tools.aot.compile_variant). Beside the
presets, LIMIT_WIDTHS gives the widest calls the kernel library takes (not launched by any preset).

    python dev/kernel_table.py [--cc 80 90] [--presets dense-1b moe-2b] [--traffic]
    python dev/kernel_table.py --record
        # after a kernel or launch changed: the compile the tests read

Prints a markdown table for docs/benchmarks/cpu.md ("Kernels compiled for sm_80 and sm_90") and
exits 1 when a preset's variant spills or needs more shared memory than a block may have; with
--traffic, also when a GPU preset's bf16 variant breaks a traffic bound (each one disassembled:
tests/kernels/test_compile_ahead.py reads one SASS per code path, see code_paths).
"""

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import pickle
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402  (after the checkout's root is importable: dev.kernel_tools)

from dev.kernel_tools import aot, traffic  # noqa: E402
from scalevec_kernels import rms_norm_scales, swiglu_norm  # noqa: E402
from scalevec_train.config import compose_config  # noqa: E402
from scalevec_train.infra.errors import ScalevecError  # noqa: E402
from scalevec_train.model.transformer import Transformer  # noqa: E402

# Captured launches and compiled usage, by what they depend on (a fresh clone starts empty).
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scalevec" / "kernel_aot"
# The sm_90 compile of every preset variant (with the SASS of each code path), as `--record` wrote
# it from a real compile: read where an entry's key (the kernel's source, the variant, the target)
# and the Triton version match, so that a fresh clone does not compile them all again (minutes of
# CI) and a changed kernel still compiles anew. tests/kernels/test_compile_ahead.py checks it
# against the compiler.
RECORD = REPO / "dev" / "kernel_tools" / "kernel_record.json"
PRESETS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml"))
# The strategies whose kernel launches differ (K outputs and scaled slots, residual, per-head and
# output norms, per-expert scales); or/er/iwd/wd_all launch what baseline or unified launch.
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
# The presets sized for a GPU (dense-0.12b ... moe-2b): the traffic bounds are about an H200
GPU_PRESET = re.compile(r"\d(\.\d+)?b$")
# The widest calls the library takes, in bf16 and fp32: K = 4 outputs with a residual, and SwiGLU.
LIMIT_WIDTHS = (8192, 16384)


def _shape(model_cfg) -> tuple:
    """What decides a preset's launches: every model option but its name and those CHEAP
    overrides."""
    skip = {"name", "n_layers", "vocab_size", "max_seq_len", "rope_theta", "kernels"}
    return tuple((k, repr(v)) for k, v in sorted(vars(model_cfg).items()) if k not in skip)


def _capture_model(model_cfg, scale_cfg, weight_grads: bool = False) -> aot.Launches:
    """The launches one model makes, forward and backward in fp32 and under bf16 autocast; none for
    a combination the framework refuses (e.g. dp on a preset with QK-norm). The weights stay
    uninitialized: the kernels write nothing under capture, so no value matters. The maps' weights
    take no gradient unless `weight_grads`: no kernel reads one, and writing them was half the
    capture's time; the scale sites and the embedding keep theirs, so every activation's gradient
    flows as in training."""
    try:
        model = Transformer(model_cfg, scale_cfg)
    except ScalevecError:
        return aot.Launches()
    if not weight_grads:
        keep = set(model.plan.site_parameters()) | {"tok_emb.weight"}
        for name, p in model.named_parameters():
            p.requires_grad_(name in keep)
    tokens = torch.zeros(1, TOKENS, dtype=torch.long)
    with aot.capture() as launches:
        for autocast in (contextlib.nullcontext,
                         lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
            with autocast():
                logits = model(tokens)
                aux = model.auxiliary_loss()
            (logits.float().sum() + (0 if aux is None else aux)).backward()
    return launches


def preset_launches(presets=PRESETS) -> tuple[dict[aot.Variant, list[str]],
                                              dict[aot.Variant, set[int]]]:
    """Every distinct variant the presets launch, with the presets that launch it, and the row
    widths (the kernels' N) the GPU-sized presets launch it with (what the traffic bounds are about:
    a binary may also serve a ladder rung's narrower rows, which no GPU run is sized for)."""
    # Composed once each: a preset's model and a strategy's scales are independent parts of the
    # config.
    models = {p: compose_config([f"model={p}", *CHEAP], 1).model for p in presets}
    scales = {name: compose_config(["model=moe-tiny", *overrides, *CHEAP], 1).scale
              for name, overrides in STRATEGIES.items()}
    users: dict[aot.Variant, list[str]] = {}
    widths: dict[aot.Variant, set[int]] = {}
    done: dict[tuple, aot.Launches] = {}
    for preset, model_cfg in models.items():
        for name, scale_cfg in scales.items():
            if scale_cfg.per_expert and model_cfg.moe is None:
                continue
            key = (_shape(model_cfg), name)
            if key not in done:
                done[key] = _capture_model(model_cfg, scale_cfg)
            for variant in done[key].variants:
                users.setdefault(variant, [])
                if GPU_PRESET.search(preset):
                    widths.setdefault(variant, set()).update(done[key].widths[variant])
                if preset not in users[variant]:
                    users[variant].append(preset)
    return users, widths


def _sources_hash() -> str:
    """Changes with anything that can change the presets' launches: the kernels' launch code, the
    model, the configs, this script and its capture, torch and triton."""
    import triton

    h = hashlib.sha256(f"{torch.__version__}-{triton.__version__}".encode())
    for pattern in ("kernels/scalevec_kernels/*.py", "scalevec_train/model/*.py",
                    "scalevec_train/*.py", "configs/**/*.yaml", "dev/kernel_table.py",
                    "dev/kernel_tools/aot.py"):
        for path in sorted(REPO.glob(pattern)):
            h.update(path.relative_to(REPO).as_posix().encode() + path.read_bytes())
    return h.hexdigest()[:16]


def cached_preset_launches(cache: Path = CACHE) -> tuple[dict[aot.Variant, list[str]],
                                                         dict[aot.Variant, set[int]]]:
    """preset_launches() of all presets, read from `cache` when nothing it depends on changed."""
    path = cache / f"launches-{_sources_hash()}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    found = preset_launches()
    cache.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(found))
    return found


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


def describe(variant: aot.Variant) -> tuple[str, str, str, str]:
    """(kernel, tile, flags, dtypes) of a variant, for the table."""
    module, name = variant.kernel.split(".")
    c = dict(variant.constexprs)
    if module == "partials":
        flags = f"K={c['K']} slots={c['SLOTS']:b} sum_e={c['SUM_E']:b}"
        return "partials reduce", f"{c['BLOCK_C']}x{c['BLOCK_L']}", flags, variant.dtype("O0")
    tile = f"{c['BLOCK_M']}x{c['BLOCK_N']}" + (" chunked" if c.get("CHUNKED") else "")
    if module == "rms_norm":
        flags = ([f"K={c['K']}", f"scaled={c['SCALED']:b}"]
                 + ["residual"] * bool(c.get("HAS_RES") or c.get("HAS_DH")))
        flags += ["per-head scale"] * ("G" not in c)
        x, scale = variant.dtype("X"), variant.dtype("S0") if c["SCALED"] & 1 else None
    else:
        flags = [f"scaled={c['SCALED']:b}", f"per_expert={c['PER_EXPERT']:b}"]
        x, scale = variant.dtype("G"), variant.dtype("SG") if c["SCALED"] & 1 else None
    dtypes = x + ("/" + scale if scale else "")
    return f"{module} {'bwd' if 'bwd' in name else 'fwd'}", tile, " ".join(flags), dtypes


def recorded() -> dict[str, dict]:
    """RECORD's entries by cache key, if it was written under this Triton."""
    import triton

    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    return record["usage"] if record.get("triton") == triton.__version__ else {}


def compile_presets(users, widths) -> dict[tuple[aot.Variant, int], aot.Usage]:
    """What the tests compile: every preset variant for sm_90, with the SASS of each code path of
    the GPU presets' row kernels (what the traffic model reads)."""
    return compile_all(users, [90], code=set(code_paths(gpu_row_variants(users), widths).values()))


def record(users, widths) -> None:
    """Write RECORD: compile_presets' results."""
    import triton

    usage = compile_presets(users, widths)
    entries = {v.cache_key(90): dataclasses.asdict(usage[v, 90]) for v in sorted(users, key=repr)}
    RECORD.write_text(json.dumps({"triton": triton.__version__, "usage": entries}, indent=0) + "\n")


def compile_all(variants, ccs, code=(),
                cache: Path = CACHE) -> dict[tuple[aot.Variant, int], aot.Usage]:
    """Each variant's usage per architecture, with the global accesses of its SASS for the variants
    in `code` (what the traffic model reads; disassembling costs more than compiling); compiled
    results are kept in `cache` by the variant's cache key (which changes with the kernel's source),
    on top of Triton's own compile cache."""
    path = cache / "usage-sass.json"
    # what this machine compiled itself
    compiled = json.loads(path.read_text()) if path.exists() else {}
    known = recorded() | compiled
    code = set(code)
    out = {}
    for v in variants:
        for cc in ccs:
            key = v.cache_key(cc)
            if key not in known or (v in code and not known[key].get("accesses")):
                known[key] = compiled[key] = dataclasses.asdict(
                    aot.compile_variant(v, cc, code=v in code))
                cache.mkdir(parents=True, exist_ok=True)
                # each result kept at once: compiling all takes minutes
                path.write_text(json.dumps(compiled))
            out[v, cc] = aot.Usage.from_json(known[key])
    return out


def table(users: dict[aot.Variant, list[str]], usage, ccs) -> list[str]:
    """One row per kernel, tile, warps and flags; its variants (input/scale dtypes, argument
    specializations) summed up by their worst case: most registers, spills and shared memory, least
    occupancy."""
    groups: dict[tuple, list[aot.Variant]] = {}
    for v in users:
        kernel, tile, flags, _ = describe(v)
        groups.setdefault((kernel, tile, v.num_warps, flags), []).append(v)
    head = ["kernel", "tile", "warps", "flags", "variants", "x/scale dtypes"]
    head += [f"{col} sm_{cc}" for cc in ccs for col in ("regs", "spill B", "smem KB", "occupancy")]
    lines = ["| " + " | ".join(head + ["launched by"]) + " |", "|" + "---|" * (len(head) + 1)]
    for (kernel, tile, warps, flags), vs in sorted(groups.items()):
        dtypes = sorted({describe(v)[3] for v in vs})
        cells = [kernel, tile, str(warps), flags, str(len(vs)), ", ".join(dtypes)]
        for cc in ccs:
            us = [usage[v, cc] for v in vs]
            cells += [str(max(u.registers for u in us)), str(max(u.spill_bytes for u in us)),
                      f"{max(u.shared_bytes for u in us) / 1024:g}",
                      f"{min(u.occupancy(warps) for u in us):.0%}"]
        presets = sorted({p for v in vs for p in users[v]})
        lines.append("| " + " | ".join(cells + [_summary(presets)]) + " |")
    return lines


def gpu_row_variants(users: dict[aot.Variant, list[str]]) -> list[aot.Variant]:
    """The row kernels' variants that the GPU-sized presets launch in bf16 (their recipes train
    under bf16 autocast): what the traffic bounds are about. The partial sums' reduction moves no
    rows."""
    out = []
    for v, presets in users.items():
        if v.kernel.startswith("partials") or not any(GPU_PRESET.search(p) for p in presets):
            continue
        if v.dtype(traffic.row_args(v)[0 if v.kernel.startswith("rms") else 1]) == "bf16":
            out.append(v)
    return out


def code_paths(variants, widths) -> dict[aot.Variant, aot.Variant]:
    """Each variant with the one that stands for its code path (kernel, flags, whole rows or
    chunked, elements a thread): the variant of that path launched with the widest rows. A path's
    variants differ in the tile's shape, which leaves what the traffic model reads from their SASS
    the same (the large tensors' reads and writes per tile, access widths, the bytes a warp has in
    flight before it waits; `--traffic` disassembles every one and fails where it differs);
    registers and width stay each one's."""
    paths: dict[tuple, list[aot.Variant]] = {}
    for v in variants:
        kernel, _, flags, _ = describe(v)
        per_thread = v.constexpr("BLOCK_M") * v.constexpr("BLOCK_N") // (32 * v.num_warps)
        paths.setdefault((kernel, flags, bool(dict(v.constexprs).get("CHUNKED")),
                          per_thread), []).append(v)
    return {v: max(vs, key=lambda u: (max(widths[u]), repr(u)))
            for vs in paths.values() for v in vs}


def audit(variants, widths, usage, cc: int = 90) -> dict[aot.Variant, traffic.Traffic]:
    """The memory traffic of each variant at the widths it is launched with, from its own usage and
    its code path's SASS (code_paths: only those need disassembling)."""
    rep = code_paths(variants, widths)
    return {v: traffic.traffic(v, dataclasses.replace(usage[v, cc],
                                                      accesses=usage[rep[v], cc].accesses,
                                                      batches=usage[rep[v], cc].batches), widths[v])
            for v in variants}


def traffic_problems(users, widths, usage) -> list[str]:
    """The bounds broken, and each variant whose own SASS gives other traffic than its code path's
    (which the CI test's reading of one SASS a path assumes)."""
    audited = gpu_row_variants(users)
    rep, found = code_paths(audited, widths), audit(audited, widths, usage)
    out = [f"{' '.join(describe(v))}: its own SASS gives other traffic than "
           f"{' '.join(describe(rep[v]))}'s"
           for v in audited if traffic.traffic(v, usage[v, 90], widths[v]) != found[v]]
    return out + [f"{' '.join(describe(v))}: {p}" for v, t in found.items() for p in t.problems()]


def traffic_table(users, widths, usage) -> list[str]:
    """One row per bf16 variant of the GPU-sized presets: its memory traffic on an H200
    (scalevec_kernels.
    traffic, from the sm_90 SASS) at the widths it is launched with; registers against the launch's
    cap."""
    head = ["kernel", "tile", "warps", "flags", "widths", "regs / cap", "programs / SM",
            "reads off chip", "bytes / floor", "access B / lane", "B a warp in flight",
            "B an SM in flight", "bounds"]
    lines = ["| " + " | ".join(head + ["launched by"]) + " |", "|" + "---|" * (len(head) + 1)]
    rows = []
    for v, t in audit(gpu_row_variants(users), widths, usage).items():
        gpu = [p for p in users[v] if GPU_PRESET.search(p)]
        kernel, tile, flags, _ = describe(v)
        reads = ", ".join(f"{a} {n:g}" for a, n in sorted(t.off_chip_reads.items()))
        rows.append([kernel, tile, str(v.num_warps), flags, ", ".join(map(str, sorted(widths[v]))),
                     f"{usage[v, 90].registers} / {v.maxnreg}",
                     str(t.programs_per_sm), reads, f"{t.bytes_over_floor:.2f}",
                     str(t.vector_bytes), str(t.warp_bytes),
                     str(t.in_flight), "; ".join(t.problems()) or "met", _summary(sorted(gpu))])
    return lines + ["| " + " | ".join(r) + " |" for r in sorted(rows)]


def _summary(presets: list[str]) -> str:
    if len(presets) <= 3:
        return ", ".join(presets) or "library limit"
    big = [p for p in presets if "." in p]  # the named sizes (dense-1b, moe-2b, ...)
    return f"{len(presets)} presets" + (f" ({', '.join(big)}, ...)" if big else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cc", type=int, nargs="+", default=[80, 90],
                        choices=sorted(aot.SHARED_PER_BLOCK))
    parser.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS)
    parser.add_argument("--traffic", action="store_true",
                        help="then the memory traffic of the GPU presets' bf16 variants on "
                             "an H200 (sm_90)")
    parser.add_argument("--record", action="store_true",
                        help=f"only write {RECORD.relative_to(REPO)}, the compile the tests read "
                             "(after a kernel or launch changed)")
    args = parser.parse_args(argv)
    import triton

    users, widths = (cached_preset_launches() if args.presets == PRESETS
                     else preset_launches(args.presets))
    if args.record:
        record(users, widths)
        return 0
    limits = {v: [] for v in limit_launches() if v not in users}
    audited = gpu_row_variants(users) if args.traffic else []
    usage = compile_all(list(users) + list(limits), args.cc, code=audited)
    print(f"Triton {triton.__version__}, compiled for {', '.join(f'sm_{cc}' for cc in args.cc)}, "
          f"{datetime.date.today()}: {len(users)} variants launched by {len(args.presets)} "
          f"presets, {len(limits)} more at the library's limits (launched by none).\n")
    print("\n".join(table(users | limits, usage, args.cc)))
    if args.traffic:
        if 90 not in args.cc:
            usage |= compile_all(audited, [90], code=audited)
        print(f"\nMemory traffic on an H200 (sm_90 SASS; {traffic.IN_FLIGHT_NEEDED} B in flight "
              "an SM needed):\n")
        print("\n".join(traffic_table(users, widths, usage)))
    bad = [f"{' '.join(describe(v))}: {p}"
           for v in users for cc in args.cc for p in usage[v, cc].problems()]
    if args.traffic:
        bad += traffic_problems(users, widths, usage)
    for problem in bad:
        print(f"FAIL {problem}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The Triton kernels compiled ahead of time, on CPU (issues 27 and 49): every launch variant the model
presets make, captured from the real launch code (scripts/kernel_table.py drives each preset under each
strategy inside scalevec_kernels.aot.capture), compiles with the local Triton for sm_90 without a
register spill, within a block's shared memory, and with a backward whose persistent grid (sized to
one wave of the SMs) fits. sm_90 only here (the GPU host's architecture; the tiles are sized by a
register model that holds on sm_80 too): `python scripts/kernel_table.py` compiles sm_80 as well.

The same compile's SASS bounds the memory traffic of every row kernel variant the GPU-sized presets
launch in bf16 (their recipes train under bf16 autocast; scalevec_kernels.traffic):

- every large tensor leaves the chip once: bytes per call at their floor (a chunked row's second read
  is served by L2);
- an SM keeps at least backend.IN_FLIGHT_NEEDED bytes in flight (an H200's bandwidth x latency / SMs)
  with at least two programs resident, 128-bit accesses.

Every such variant is checked, but only one SASS per code path is read (kernel_table.code_paths: kernel,
flags, whole rows or chunked, elements a thread; 29 paths for 86 variants, 2026-11-28): disassembling
costs 0.4 s of CPU a variant, more than CI can spare. That suffices because what the bounds take from the
SASS (which large tensors each access touches, its width, the loads a warp has in flight before it
waits) is the same for every variant of a path: they differ in the tile's shape only; each
variant's own registers (programs per SM) and row width (idle lanes, the L2 working set) are its own.
`python scripts/kernel_table.py --traffic` disassembles every variant and exits 1 where one's SASS
gives other traffic than its path's or a bound breaks.

One capture and one compile of each variant serve every test (the module fixture `compiled`, one file so
that one test worker does it), cached (kernel_table.CACHE) by what they depend on on top of Triton's
compile cache. A fresh clone reads the compile from kernel_table.RECORD, written by a real compile with
`python scripts/kernel_table.py --record`, where an entry's key (the kernel's source, the variant, the
target) and the Triton version match: compiling all of them took 150 s of a cold CI run (2026-11-28).
A changed kernel compiles anew, and test_the_record_is_up_to_date_and_what_the_compiler_gives recompiles
one variant of every kernel and checks the record against it.
"""

import importlib

import pytest
import torch

from scalevec_kernels import aot, backend, rms_norm, rms_norm_scales, swiglu_norm, traffic
from scalevec_train.config import compose_config
from tests.support.helpers import REPO, load_script

pytest.importorskip("triton")
if backend.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: these tests compile the kernels", allow_module_level=True)
kernel_table = load_script(REPO / "scripts" / "kernel_table.py")
CC = 90


@pytest.fixture(scope="module")
def compiled():
    """(the variants with the presets launching each, their row widths, their sm_90 usage)."""
    users, widths = kernel_table.cached_preset_launches()
    return users, widths, kernel_table.compile_presets(users, widths)


@pytest.fixture(scope="module")
def launches(compiled):
    return compiled[0]


@pytest.fixture(scope="module")
def audited(compiled):
    users, widths, usage = compiled
    found = kernel_table.audit(kernel_table.gpu_row_variants(users), widths, usage, CC)
    return {v: (max(widths[v]), t) for v, t in found.items()}


def test_the_record_is_up_to_date_and_what_the_compiler_gives(compiled):
    import triton

    users, widths, _ = compiled
    record = kernel_table.recorded()
    if not record:
        pytest.skip(f"{kernel_table.RECORD.name} was written under another Triton than {triton.__version__}: "
                    "every variant compiled here")
    missing = [v for v in users if v.cache_key(CC) not in record]
    assert not missing, (f"{len(missing)} variants not in {kernel_table.RECORD.name} (a kernel or launch changed). "
                         "Fix: python scripts/kernel_table.py --record")
    paths = set(kernel_table.code_paths(kernel_table.gpu_row_variants(users), widths).values())
    for kernel in sorted({v.kernel for v in users}):  # one of each kernel, with its SASS where it has one
        variant = min((v for v in users if v.kernel == kernel), key=lambda v: (v not in paths, repr(v)))
        assert aot.compile_variant(variant, CC, code=variant in paths) == aot.Usage.from_json(
            record[variant.cache_key(CC)]), kernel


def test_presets_launch_every_kernel_and_the_chunked_backward(launches):
    kinds = {kernel_table.describe(v)[0] for v in launches}
    assert kinds == {"rms_norm fwd", "rms_norm bwd", "swiglu_norm fwd", "swiglu_norm bwd", "partials reduce"}
    # dense-1b's FFN is 8192 wide: under unified its fused SwiGLU forward and backward walk rows in chunks.
    chunked = {v.kernel for v, presets in launches.items() if "dense-1b" in presets
               and dict(v.constexprs).get("CHUNKED")}
    assert {"swiglu_norm._fwd_kernel", "swiglu_norm._bwd_kernel"} <= chunked


def test_every_preset_variant_compiles_without_spills(compiled):
    launches, _, usage = compiled
    problems = [f"{' '.join(kernel_table.describe(v))} ({', '.join(launches[v][:3])}): {p}"
                for v in launches for p in usage[v, CC].problems()]
    assert not problems, "\n".join(problems)
    # backend.resident_programs sizes a backward's grid to WARPS_PER_SM warps per SM: they must fit.
    crowded = [kernel_table.describe(v) for v in launches if "bwd" in v.kernel
               and usage[v, CC].blocks_per_sm(v.num_warps) * v.num_warps < backend.WARPS_PER_SM]
    assert not crowded, crowded


@pytest.mark.parametrize("preset,strategy", [("dense-tiny-gemma", "baseline"), ("dense-tiny", "unified-full-heads"),
                                             ("moe-tiny", "unified-per-expert"), ("moe-tiny", "none")])
def test_the_capture_without_weight_gradients_launches_what_training_launches(preset, strategy):
    """The capture leaves the maps' weights without gradients (kernel_table._capture_model): with them, as
    training has them, the same variants launch, in the same order."""
    model = compose_config([f"model={preset}", *kernel_table.CHEAP], 1).model
    scale = compose_config(["model=moe-tiny", *kernel_table.STRATEGIES[strategy], *kernel_table.CHEAP], 1).scale
    frozen = kernel_table._capture_model(model, scale)
    trained = kernel_table._capture_model(model, scale, weight_grads=True)
    assert frozen.variants and frozen.variants == trained.variants and frozen.widths == trained.widths


def _rms_norm_variants(n: int, k: int) -> list[aot.Variant]:
    """The variants of K outputs with a residual at width n in bf16, forward and backward."""
    with aot.capture() as captured:
        x, r = (torch.randn(16, n, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        scales = [torch.ones(n, requires_grad=True) for _ in range(k)]
        outs = rms_norm_scales(x, scales, 1e-6, residual=r, backend="triton")
        torch.autograd.grad(outs, [x, r, *scales], [torch.ones_like(o) for o in outs])
    return captured.variants


def test_widest_rows_do_not_spill_in_the_backward():
    """16384 features (the library's limit, wider than any preset) with K = 4: the chunked backward."""
    (bwd,) = [v for v in _rms_norm_variants(16384, 4) if v.kernel == "rms_norm._bwd_kernel"]
    assert dict(bwd.constexprs)["CHUNKED"]
    assert aot.compile_variant(bwd, CC, code=False).problems() == []


def test_a_spilling_tile_is_caught(monkeypatch):
    """The tiling before issue 27: whole rows of 8192 in one tile of 16 warps (16 elements a thread)
    holding K = 4 accumulators spills, and the check says so."""
    monkeypatch.setattr(rms_norm, "_BWD_TILE", 8192)
    monkeypatch.setattr(backend, "MAX_WARPS", 16)
    monkeypatch.setattr(backend, "BACKWARD_PER_THREAD", 16)
    (bwd,) = [v for v in _rms_norm_variants(8192, 4) if v.kernel == "rms_norm._bwd_kernel"]
    assert dict(bwd.constexprs)["BLOCK_N"] == 8192 and bwd.num_warps == 16
    usage = aot.compile_variant(bwd, CC, code=False)
    assert usage.spill_bytes > 0
    assert usage.problems() == [f"spills {usage.spill_bytes} B per thread to local memory (sm_90)"]


def test_occupancy_and_shared_memory_limits():
    """Occupancy from registers (65536 per SM, given to warps in units of 256) and shared memory."""
    full = aot.Usage(cc=90, registers=128, spill_bytes=0, shared_bytes=16384)
    assert full.blocks_per_sm(16) == 1 and full.occupancy(16) == 0.25
    assert aot.Usage(90, 64, 0, 0).occupancy(16) == 0.5
    # 41 registers round up to 48 a thread: 1536 a warp, 65536 // (1536 * 8) = 5 blocks of 8 warps
    assert aot.Usage(90, 41, 0, 0).blocks_per_sm(8) == 5
    assert aot.Usage(90, 32, 0, 100 * 1024).blocks_per_sm(4) == 2  # 228 KB of shared memory an SM
    assert aot.Usage(90, 32, 0, 200 * 1024).problems() == []
    assert aot.Usage(80, 32, 0, 200 * 1024).problems() == [
        f"needs {200 * 1024} B of shared memory, over sm_80's {163 * 1024} B per block"]


def test_the_in_flight_rules():
    """The tiles and register caps the launches take from Little's law (backend.IN_FLIGHT_NEEDED = 29,091 B
    an SM), against the arithmetic written out here."""
    assert backend.IN_FLIGHT_NEEDED == 29091
    # Lanes a row keeps busy: 2560 features in a tile of 4096, or in 3 chunks of 1024
    assert backend.active_share(2560, 4096) == 0.625 and backend.active_share(2560, 1024) == 2560 / 3072
    assert backend.active_share(8192, 4096) == 1.0
    # Backward (BLOCK_M, BLOCK_N, warps, elements a thread), 16 warps an SM: bf16 x and one gradient (4 B an
    # element, 6 with dx) keep 4 x 16 x 512 = 32,768 B at 16 a thread on 2048 features; on 2560 a chunk of
    # 4096 keeps 5/8 of that, 1024 5/6 (3 chunks), 512 all of it but with 8 rows a tile the 264 programs'
    # rows (132 x 2 x 8 x 2560 x 6 B = 32 MB) overflow half the 50 MB L2: so 32 a thread, in 2 rows of 4096,
    # unless the kernel holds at most 16; with three gradients (8 B) 8 a thread keep 32,768 on 1024
    assert backend.backward_tile(2048, 4, 6, 32) == (2, 2048, 8, 16)
    assert backend.backward_tile(2560, 4, 6, 32) == (2, 4096, 8, 32)
    assert backend.backward_tile(2560, 4, 6, 16) == (1, 4096, 8, 16)
    assert backend.backward_tile(1024, 8, 10, 32) == (2, 1024, 8, 8)
    # G, U and the output's gradient (6 B, 10 with dG and dU) on 2304 features: a chunk of 4096 keeps
    # 27,648 B, one of 1024 (3 chunks, 3/4 busy) 36,864 with 4 rows, 24 MB of them on the device: it fits
    assert backend.backward_tile(2304, 6, 10, 16) == (4, 1024, 8, 16)
    # Forward: a program of 8 warps on one bf16 row of 2560 in a tile of 4096 has 4096 x 2 x 5/8 = 5,120 B
    # in flight, so 6 programs an SM, 65536 / (6 x 256) = 42 registers a thread, 40 in units of 8, unless
    # the kernel needs more; two bf16 tensors on 8 rows of 384 in tiles of 512: 12,288 B, 3 programs,
    # 85 -> 80; rows that fill their tile are not capped (two programs of 16 warps would need 64)
    assert backend.forward_registers(2560, 1, 4096, 8, 2, 32) == 40
    assert backend.forward_registers(2560, 1, 4096, 8, 2, 48) == 48
    assert backend.forward_registers(384, 8, 512, 8, 4, 48) == 80
    assert backend.forward_registers(16384, 1, 16384, 16, 4, 48) == 128


def test_every_large_tensor_leaves_the_chip_once(audited):
    over = {kernel_table.describe(v): (t.off_chip_reads, t.writes) for v, (_, t) in audited.items()
            if t.bytes_over_floor != 1.0}
    assert not over, over
    # dense-1b's FFN (8192 wide): both SwiGLU kernels read their rows twice, the second time from L2
    wide = [t for v, (width, t) in audited.items() if "swiglu" in v.kernel and width == 8192]
    assert len(wide) == 2 and all(max(t.reads.values()) == 2 and 0 < t.working_set <= backend.L2_BYTES // 2
                                  for t in wide)


def test_each_sm_keeps_enough_in_flight(audited):
    short = {kernel_table.describe(v): t.problems() for v, (_, t) in audited.items() if t.problems()}
    assert not short, short
    assert all(t.vector_bytes == 16 for _, t in audited.values())  # 128-bit loads and stores of every row


def _swiglu_variants(f: int, dtype: torch.dtype) -> list[aot.Variant]:
    with aot.capture() as captured:
        g, u = (torch.randn(16, f, dtype=dtype, requires_grad=True) for _ in range(2))
        scales = [torch.ones(f, requires_grad=True) for _ in range(2)]
        out = swiglu_norm(g, u, *scales, 1e-6, backend="triton")
        torch.autograd.grad(out, [g, u, *scales], torch.ones_like(out))
    return captured.variants


def test_a_second_pass_the_l2_cannot_hold_is_caught(compiled):
    """fp32 rows of 16384 features (the library's widest) walked twice by the forward, which launches the
    binary dense-1b's fp32 rows of 8192 do: what the device reads between a chunk's two reads is over half
    the L2, so the second read leaves the chip and the call moves more than its floor."""
    users = compiled[0]
    (fwd,) = [v for v in _swiglu_variants(16384, torch.float32) if v.kernel == "swiglu_norm._fwd_kernel"]
    assert fwd.constexpr("CHUNKED") and "dense-1b" in users[fwd]
    t = traffic.traffic(fwd, aot.compile_variant(fwd, CC), {16384})  # its SASS: the fixture reads bf16's
    assert t.working_set > backend.L2_BYTES // 2 and t.bytes_over_floor > 1.5
    assert "reads G 2 times off the chip" in t.problems()


def test_a_launch_with_too_little_in_flight_is_caught(monkeypatch):
    """The SwiGLU backward of dense-1b at 4 elements a thread: a quarter of what its loads keep in flight."""
    monkeypatch.setattr(importlib.import_module("scalevec_kernels.swiglu_norm"), "backward_tile",
                        lambda *_: (1, 1024, 8, 4))
    (bwd,) = [v for v in _swiglu_variants(8192, torch.bfloat16) if v.kernel == "swiglu_norm._bwd_kernel"]
    t = traffic.traffic(bwd, aot.compile_variant(bwd, CC), {8192})
    assert t.in_flight < backend.IN_FLIGHT_NEEDED
    want = f"keeps {t.in_flight} B in flight per SM, under the {backend.IN_FLIGHT_NEEDED} B an H200 needs"
    assert want in t.problems()

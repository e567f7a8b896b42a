"""The Triton kernels compiled ahead of time, on CPU (issues 27 and 49): every launch variant the
model presets make, captured from the real launch code (dev/kernel_table.py drives each preset under
each strategy inside dev/kernel_tools/aot.py's capture), compiles with the local Triton for sm_90
without a register spill, within a block's shared memory, and with a backward whose persistent grid
(sized to one wave of the SMs) fits. sm_90 only here (the GPU host's architecture; the tiles are
sized by a register model that holds on sm_80 too): `python dev/kernel_table.py` compiles sm_80 as
well.

The same compile's SASS bounds the memory traffic of every row kernel variant the GPU-sized presets
launch in bf16 (their recipes train under bf16 autocast; dev/kernel_tools/traffic.py):

- every large tensor leaves the chip once: bytes per call at their floor (a chunked row's second
  read is served by L2);
- an SM keeps at least backend.IN_FLIGHT_NEEDED bytes in flight (an H200's bandwidth x latency /
  SMs) with at least two programs resident, 128-bit accesses.

Every such variant is checked, but only one SASS per code path is read (kernel_table.code_paths:
kernel, flags, whole rows or chunked, elements a thread; 29 paths for 86 variants, 2026-11-28):
disassembling costs 0.4 s of CPU a variant, more than CI can spare. That suffices because what the
bounds take from the SASS (which large tensors each access touches, its width, the loads a warp has
in flight before it waits) is the same for every variant of a path: they differ in the tile's shape
only; each variant's own registers (programs per SM) and row width (idle lanes, the L2 working set)
are its own. `python dev/kernel_table.py --traffic` disassembles every variant and exits 1 where
one's SASS gives other traffic than its path's or a bound breaks.

One capture and one compile of each variant serve every test (the module fixture `compiled`, one
file so that one test worker does it), cached (kernel_table.CACHE) by what they depend on on top of
Triton's compile cache. A fresh clone reads the compile from kernel_table.RECORD, written by a real
compile with `python dev/kernel_table.py --record`, where an entry's key (the kernel's source, the
variant, the target) and the Triton version match: compiling all of them took 150 s of a cold CI run
(2026-11-28). A changed kernel compiles anew, and
test_the_record_is_up_to_date_and_what_the_compiler_gives recompiles one variant of every kernel and
checks the record against it (here, not with the tools' own tests in tests/dev/, because it needs
every preset's launches: this file's capture).
"""

import pytest

from dev.kernel_tools import aot
from scalevec_kernels import backend
from tests.support.helpers import REPO, load_script
from tests.support.kernels import rms_norm_variants

pytest.importorskip("triton")
if backend.INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: these tests compile the kernels", allow_module_level=True)
kernel_table = load_script(REPO / "dev" / "kernel_table.py")
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
        pytest.skip(f"{kernel_table.RECORD.name} was written under another Triton than "
                    f"{triton.__version__}: every variant compiled here")
    missing = [v for v in users if v.cache_key(CC) not in record]
    assert not missing, (f"{len(missing)} variants not in {kernel_table.RECORD.name} "
                         "(a kernel or launch changed). Fix: python dev/kernel_table.py --record")
    paths = set(kernel_table.code_paths(kernel_table.gpu_row_variants(users), widths).values())
    # one of each kernel, with its SASS where it has one
    for kernel in sorted({v.kernel for v in users}):
        variant = min((v for v in users if v.kernel == kernel),
                      key=lambda v: (v not in paths, repr(v)))
        assert aot.compile_variant(variant, CC, code=variant in paths) == aot.Usage.from_json(
            record[variant.cache_key(CC)]), kernel


def test_presets_launch_every_kernel_and_the_chunked_backward(launches):
    kinds = {kernel_table.describe(v)[0] for v in launches}
    assert kinds == {"rms_norm fwd", "rms_norm bwd", "swiglu_norm fwd", "swiglu_norm bwd",
                     "partials reduce"}
    # dense-1b's FFN is 8192 wide: under unified its fused SwiGLU forward and backward walk rows in
    # chunks.
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


def test_widest_rows_do_not_spill_in_the_backward():
    """16384 features (the library's limit, wider than any preset) with K = 4: the chunked
    backward."""
    (bwd,) = [v for v in rms_norm_variants(16384, 4) if v.kernel == "rms_norm._bwd_kernel"]
    assert dict(bwd.constexprs)["CHUNKED"]
    assert aot.compile_variant(bwd, CC, code=False).problems() == []


def test_the_in_flight_rules():
    """The tiles and register caps the launches take from Little's law (backend.IN_FLIGHT_NEEDED =
    29,091 B an SM), against the arithmetic written out here."""
    assert backend.IN_FLIGHT_NEEDED == 29091
    # Lanes a row keeps busy: 2560 features in a tile of 4096, or in 3 chunks of 1024
    assert (backend.active_share(2560, 4096) == 0.625
            and backend.active_share(2560, 1024) == 2560 / 3072)
    assert backend.active_share(8192, 4096) == 1.0
    # Backward (BLOCK_M, BLOCK_N, warps, elements a thread), 16 warps an SM: bf16 x and one gradient
    # (4 B an element, 6 with dx) keep 4 x 16 x 512 = 32,768 B at 16 a thread on 2048 features; on
    # 2560 a chunk of 4096 keeps 5/8 of that, 1024 5/6 (3 chunks), 512 all of it but with 8 rows a
    # tile the 264 programs' rows (132 x 2 x 8 x 2560 x 6 B = 32 MB) overflow half the 50 MB L2: so
    # 32 a thread, in 2 rows of 4096, unless the kernel holds at most 16; with three gradients (8 B)
    # 8 a thread keep 32,768 on 1024
    assert backend.backward_tile(2048, 4, 6, 32) == (2, 2048, 8, 16)
    assert backend.backward_tile(2560, 4, 6, 32) == (2, 4096, 8, 32)
    assert backend.backward_tile(2560, 4, 6, 16) == (1, 4096, 8, 16)
    assert backend.backward_tile(1024, 8, 10, 32) == (2, 1024, 8, 8)
    # G, U and the output's gradient (6 B, 10 with dG and dU) on 2304 features: a chunk of 4096
    # keeps 27,648 B, one of 1024 (3 chunks, 3/4 busy) 36,864 with 4 rows, 24 MB of them on the
    # device: it fits
    assert backend.backward_tile(2304, 6, 10, 16) == (4, 1024, 8, 16)
    # Forward: a program of 8 warps on one bf16 row of 2560 in a tile of 4096 has 4096 x 2 x 5/8 =
    # 5,120 B in flight, so 6 programs an SM, 65536 / (6 x 256) = 42 registers a thread, 40 in units
    # of 8, unless the kernel needs more; two bf16 tensors on 8 rows of 384 in tiles of 512: 12,288
    # B, 3 programs, 85 -> 80; rows that fill their tile are not capped (two programs of 16 warps
    # would need 64)
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
    assert len(wide) == 2 and all(max(t.reads.values()) == 2
                                  and 0 < t.working_set <= backend.L2_BYTES // 2 for t in wide)


def test_each_sm_keeps_enough_in_flight(audited):
    short = {kernel_table.describe(v): t.problems() for v, (_, t) in audited.items()
             if t.problems()}
    assert not short, short
    # 128-bit loads and stores of every row
    assert all(t.vector_bytes == 16 for _, t in audited.values())

"""scalevec_kernels' kernels compiled ahead of time, without a GPU: which launch variants a workload
makes, and what each costs in registers, spills, shared memory and occupancy on a given GPU
architecture.

    with capture() as launches:     # the ops record their launches instead of running the kernels,
        run_the_workload_on_cpu()   # on CPU tensors, interpreter or not, with the real launch code
    for variant in launches.variants:
        usage = compile_variant(variant, 90)   # Triton's compiler for sm_90; no driver needed

A variant is what Triton compiles one binary for: the kernel, its argument types and specializations
(as triton's own launcher derives them: pointer alignment, integers equal to 1 or divisible by 16),
constexprs and num_warps. The kernels' outputs under capture are left unwritten (torch.empty), so a
workload's numbers are meaningless but its shapes, dtypes, and so its launches, are the real ones.

Registers and the per-thread local frame (bytes a thread spills to local memory) come from the cubin
(cuobjdump -res-usage, bundled with triton), shared memory from the compiled kernel's metadata, and
the global loads and stores with the batches of loads a warp keeps in flight from its SASS
(sass.py).
"""

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator

from scalevec_kernels import backend
from scalevec_kernels.errors import KernelError

from . import sass

# Per architecture (compute capability): shared memory one block may use, and per SM.
SHARED_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 64, 32
# The kernels by module of scalevec_kernels (imported by name: the package's names rms_norm etc. are
# the functions, see its __init__.py), and the modules that route a call to them or to the
# reference.
_KERNELS = {"rms_norm": ("_fwd_kernel", "_bwd_kernel"),
            "swiglu_norm": ("_fwd_kernel", "_bwd_kernel"), "partials": ("_reduce_kernel",)}
_ROUTING_MODULES = tuple(importlib.import_module(f"scalevec_kernels.{m}")
                         for m in ("rms_norm", "swiglu_norm", "head_rms_norm"))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled binary: `kernel` is module.function, `signature` the argument types by name
    (pointers as '*bf16', ...; 'constexpr' for specialized ones), `constexprs` the compile-time
    values by name."""
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    attrs: str
    num_warps: int
    num_stages: int
    maxnreg: int | None
    # triton.compile's arguments: signature, constexprs and attrs by argument index
    packed: tuple = dataclasses.field(compare=False, repr=False)

    @property
    def params(self) -> list[str | None]:
        """The compiled kernel's parameters in order (the arguments that are not compile-time
        constants), by name for pointers, None for scalars: what sass.analyze takes."""
        return [name if kind.startswith("*") else None for name, kind in self.signature
                if kind != "constexpr"]

    def constexpr(self, name: str):
        return dict(self.constexprs)[name]

    @property
    def fn(self):
        """The kernel's JITFunction (looked up by name, so that a variant pickles)."""
        module, name = self.kernel.split(".")
        fn = getattr(importlib.import_module(f"scalevec_kernels.{module}"), name)
        return fn.fn if isinstance(fn, _Recorder) else fn

    def dtype(self, arg: str) -> str:
        return dict(self.signature)[arg].lstrip("*")

    def cache_key(self, cc: int) -> str:
        """Changes with the kernel's source (triton's own hash of it), the variant and the
        target."""
        return hashlib.sha256(f"{self.fn.cache_key}-{self!r}-{cc}".encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Usage:
    """A compiled variant's resources on one architecture, per thread (registers, spill_bytes) or
    per block."""
    cc: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    # From the SASS (empty unless compile_variant read it): each global access as (kind, argument,
    # bytes per lane), in program order, and the batches of loads in flight together as indices into
    # `accesses`
    accesses: tuple[tuple[str, str | None, int], ...] = ()
    batches: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def from_json(cls, fields: dict) -> "Usage":
        fields = dict(fields)
        fields["accesses"] = tuple(tuple(a) for a in fields.get("accesses", ()))
        fields["batches"] = tuple(tuple(b) for b in fields.get("batches", ()))
        return cls(**fields)

    def blocks_per_sm(self, num_warps: int) -> int:
        per_warp = -(-self.registers // backend.REGISTER_UNIT) * backend.REGISTER_UNIT * 32
        by_regs = backend.REGISTERS_PER_SM // (per_warp * num_warps)
        by_shared = (SHARED_PER_SM[self.cc] // self.shared_bytes if self.shared_bytes
                     else MAX_BLOCKS_PER_SM)
        return min(by_regs, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM)

    def occupancy(self, num_warps: int) -> float:
        """Resident warps per SM as a share of the most an SM holds (64)."""
        return self.blocks_per_sm(num_warps) * num_warps / MAX_WARPS_PER_SM

    def problems(self) -> list[str]:
        """What makes the variant unfit: spills, or more shared memory than a block may have."""
        out = []
        if self.spill_bytes:
            out.append(f"spills {self.spill_bytes} B per thread to local memory (sm_{self.cc})")
        if self.shared_bytes > SHARED_PER_BLOCK[self.cc]:
            out.append(f"needs {self.shared_bytes} B of shared memory, over sm_{self.cc}'s "
                       f"{SHARED_PER_BLOCK[self.cc]} B per block")
        return out


class Launches:
    """The distinct variants launched under a capture, in first-launch order."""

    def __init__(self):
        self._seen: dict[Variant, None] = {}
        # The row widths (the kernel's N argument) each variant was launched with
        self.widths: dict[Variant, set[int]] = {}
        # Every launch's kernel (module.function), in order
        self.calls: list[str] = []

    @property
    def variants(self) -> list[Variant]:
        return list(self._seen)

    def record(self, fn, args: tuple, kwargs: dict) -> None:
        target, backend_, binder = _binding(fn)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend_, kwargs, bound,
                                                              specialization, options)
        names = fn.arg_names
        variant = Variant(
            kernel=f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}",
            signature=tuple(signature.items()),
            constexprs=tuple((names[path[0]], value) for path, value in sorted(constexprs.items())),
            attrs=repr(sorted(attrs.items())), num_warps=options.num_warps,
            num_stages=options.num_stages, maxnreg=options.maxnreg,
            packed=(signature, constexprs, attrs))
        self._seen.setdefault(variant)
        self.calls.append(variant.kernel)
        self.widths.setdefault(variant, set()).add(bound["N"])


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch, runs
    nothing."""

    def __init__(self, fn, launches: Launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.record(self.fn, args, kwargs)


@functools.cache
def _binding(fn):
    """Triton's own argument binder for fn, as the launcher of an sm_90 device builds it (the
    specializations it derives do not depend on the architecture)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend_ = make_backend(target)
    return target, backend_, create_function_from_signature(fn.signature, fn.params, backend_)


@contextlib.contextmanager
def capture(sm_count: int = 132) -> Iterator[Launches]:
    """Within the block, the ops take the kernel path on any device as they would on a CUDA device
    with `sm_count` SMs (132: an H100 SXM), and record each kernel launch instead of running it."""
    if backend.triton is None:
        raise KernelError("capture needs the triton package.", "Install triton.")
    if backend.INTERPRETED:
        raise KernelError("capture needs the compiled kernels, not triton's interpreter.",
                          "Unset TRITON_INTERPRET before importing scalevec_kernels.")
    launches = Launches()
    saved = []

    def patch(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    try:
        for module, names in _KERNELS.items():
            module = importlib.import_module(f"scalevec_kernels.{module}")
            for name in names:
                patch(module, name, _Recorder(getattr(module, name), launches))
        patch(backend, "sm_count", lambda device: sm_count)
        with routed_as_cuda():
            yield launches
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


@contextlib.contextmanager
def routed_as_cuda() -> Iterator[None]:
    """Within the block, each op decides its path for tensors on any device as it would for CUDA
    tensors (the kernels then run where they can: under triton's interpreter on CPU tensors)."""
    saved = [module.use_triton for module in _ROUTING_MODULES]
    for module in _ROUTING_MODULES:
        module.use_triton = functools.partial(backend.use_triton, device_type="cuda")
    try:
        yield
    finally:
        for module, use_triton in zip(_ROUTING_MODULES, saved, strict=True):
            module.use_triton = use_triton


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise KernelError(f"no cuobjdump at {path}.",
                          "Use a triton wheel with the NVIDIA backend's tools.")
    return path


def compile_variant(variant: Variant, cc: int, code: bool = True) -> Usage:
    """Compile with Triton's compiler for sm_<cc> (80, 90) and read the binary's resource usage, and
    with `code` its global accesses from the SASS (sass.py: disassembling takes about 0.4 s of CPU a
    variant, more than the compile). Triton's compile cache (TRITON_CACHE_DIR) makes a repeated
    compile a cache read."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    signature, constexprs, attrs = variant.packed
    target = GPUTarget("cuda", cc, 32)
    # The options as the target's own backend derives them from the launch's (another architecture's
    # defaults would select instructions this one lacks).
    options = make_backend(target).parse_options({"num_warps": variant.num_warps,
                                                  "num_stages": variant.num_stages,
                                                  "maxnreg": variant.maxnreg})
    kernel = triton.compile(ASTSource(variant.fn, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        report = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True,
                                text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", report))
    usage = Usage(cc=cc, registers=int(fields["REG"]),
                  spill_bytes=int(fields["STACK"]) + int(fields["LOCAL"]),
                  shared_bytes=kernel.metadata.shared)
    if not code:
        return usage
    found = sass.analyze(kernel.asm["cubin"], variant.params, cc, _cuobjdump())
    index = {id(a): i for i, a in enumerate(found.accesses)}
    return dataclasses.replace(usage,
                               accesses=tuple((a.kind, a.arg, a.width) for a in found.accesses),
                               batches=tuple(tuple(index[id(a)] for a in batch)
                                             for batch in found.batches))

"""What a compiled kernel does with global memory, read from its SASS (the machine code ptxas
wrote): each load and store, the kernel argument it addresses, its width per lane, and which loads a
warp issues before it first has to wait for one of them.

A GPU warp does not wait when it issues a load; it waits at the first instruction that reads a
register the load writes (or overwrites one). So the loads issued between two such waits are in
flight together: `batches` lists them, in program order, as (argument, bytes per lane). A loop's
body is read once, in order, which is what each of its iterations issues.

The argument an address comes from is found by following the registers it is computed from back to
the kernel's parameters (constant bank 0, at the offsets the cubin's EIATTR_KPARAM_INFO gives each
parameter): the last definition of each register in program order, which is exact for the
straight-line address arithmetic of these kernels and, in a loop, keeps the loop-carried pointer's
argument.
"""

import dataclasses
import re
import subprocess
import tempfile

# Where the kernel parameters start in constant bank 0, per architecture (compute capability).
PARAM_BASE = {80: 0x160, 90: 0x210}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_REG = re.compile(r"\b(U?R)(\d+)(\.64)?\b")
_CONST = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_KPARAM = re.compile(r"Ordinal\s*:\s*(0x[0-9a-f]+)\s+Offset\s*:\s*(0x[0-9a-f]+)"
                     r"\s+Size\s*:\s*(0x[0-9a-f]+)")
# Instructions whose first operand is not a register they write.
_NO_DEST = ("ST", "RED", "ATOM", "BAR", "BRA", "EXIT", "RET", "CALL", "BSYNC", "BSSY", "WARPSYNC",
            "NOP", "MEMBAR", "FENCE", "ERRBAR", "DEPBAR", "YIELD", "ISETP", "FSETP", "PLOP3",
            "VOTE", "R2UR")


@dataclasses.dataclass(frozen=True)
class Access:
    """One global load or store: `arg` is the kernel argument its address comes from (None: none
    found), `width` its bytes per lane (16: a 128-bit vector access)."""
    kind: str  # "load" | "store"
    arg: str | None
    width: int


@dataclasses.dataclass(frozen=True)
class Sass:
    accesses: tuple[Access, ...]
    # The loads in flight together: each batch ends where the warp first waits for one of them.
    batches: tuple[tuple[Access, ...], ...]


def _width(opcode: str) -> int:
    for suffix, width in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                          (".S8", 1)):
        if suffix in opcode:
            return width
    return 4


def _regs(text: str) -> set[str]:
    """Registers an operand text names; R4.64 is the pair R4, R5 (RZ/URZ, the zero register, is
    none)."""
    out = set()
    for kind, num, pair in _REG.findall(text):
        out.add(f"{kind}{num}")
        if pair:
            out.add(f"{kind}{int(num) + 1}")
    return out


def _span(first: str, width: int) -> set[str]:
    """The registers a load of `width` bytes per lane writes (or a store reads) from register
    `first` on; none for the zero register (a store of zeros)."""
    if first in ("RZ", "URZ"):
        return set()
    kind, num = re.fullmatch(r"(U?R)(\d+)", first).groups()
    return {f"{kind}{int(num) + i}" for i in range(max(1, width // 4))}


def _params(cubin_path: str, cuobjdump: str, names: list[str | None], cc: int) -> dict[int, str]:
    """Constant-bank offset -> argument name, for the parameters `names`: the kernel's arguments
    that are not compile-time constants, in order, None for those that are not pointers (Triton's
    own trailing scratch pointers get no name)."""
    elf = subprocess.run([cuobjdump, "-elf", cubin_path], capture_output=True, text=True,
                         check=True).stdout
    out = {}
    for ordinal, offset, size in _KPARAM.findall(elf):
        ordinal, offset = int(ordinal, 16), int(offset, 16)
        if ordinal < len(names) and names[ordinal] is not None:
            for word in range(0, int(size, 16), 4):
                out[PARAM_BASE[cc] + offset + word] = names[ordinal]
    return out


def analyze(cubin: bytes, names: list[str], cc: int, cuobjdump: str) -> Sass:
    """The global accesses and load batches of one kernel's cubin; `names` as for _params."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        params = _params(f.name, cuobjdump, names, cc)
        listing = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                                 check=True).stdout
    origin: dict[str, frozenset[str]] = {}  # register -> the arguments its value derives from
    accesses, batches, batch = [], [], []
    pending: set[str] = set()  # registers the loads in flight will write
    for _, opcode, operands in _LINE.findall(listing):
        parts = [p.strip() for p in operands.split(",")] if operands.strip() else []
        base = opcode.split(".")[0]
        writes_first = parts and not base.startswith(_NO_DEST) and _REG.match(parts[0])
        dest = _regs(parts[0]) if writes_first else set()
        if dest and (".64" in opcode or ".WIDE" in opcode or base == "CS2R"):  # a register pair
            dest = _regs(parts[0].split(".")[0] + ".64")
        sources = (set().union(*(_regs(p) for p in parts[1 if writes_first else 0:])) if parts
                   else set())
        if base in ("LDG", "STG"):
            address = next(p for p in parts if "[" in p)
            width = _width(opcode)
            args = frozenset().union(*(origin.get(r, frozenset())
                                       for r in _regs(address.split("[", 2)[-1])))
            access = Access("load" if base == "LDG" else "store",
                            min(args) if len(args) == 1 else None, width)
            accesses.append(access)
            if base == "STG":
                sources = (_regs(address) | _span(parts[-1], width) if parts[-1].startswith("R")
                           else _regs(address))
            else:
                dest = _span(parts[0], width)
        if pending & (sources | dest):  # the warp waits here for the loads in flight
            batches.append(tuple(batch))
            batch, pending = [], set()
        if base == "LDG":
            batch.append(accesses[-1])
            pending |= dest
        derived = frozenset(params[int(c, 16)] for c in _CONST.findall(operands)
                            if int(c, 16) in params)
        if base != "LDG":  # a loaded value is data, not an address into the argument it came from
            derived = derived.union(*(origin.get(r, frozenset()) for r in sources))
        for r in dest:
            origin[r] = derived
    if batch:
        batches.append(tuple(batch))
    return Sass(tuple(accesses), tuple(batches))

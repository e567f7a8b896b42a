"""Where an MoE layer's forward and backward go, counted on the CPU: the operators it dispatches
(each a kernel launch on a GPU in eager mode), the bytes each reads and writes, the grouped matrix
multiplies and their shapes, and the host reads (issue 49, item 4).

    python dev/moe_account.py  # moe-2b's layer, 16,384 tokens, baseline and unified
    python dev/moe_account.py --preset moe-0.5b --tokens 2048 --scales baseline

One MoE layer of the preset (its real widths, experts and top-k) runs forward and backward under
bf16 autocast with random weights and balanced routing (the expert bias cancels the router's
preference, as the auxiliary-loss-free update does in training), inside a TorchDispatchMode that
sees every aten operator. For each operator that runs a kernel (views and metadata excluded) it
records:
  phase     the part of model/moe.py it serves: router, routing (sort, offsets, counts), dispatch
            (the gather of token rows into expert order), expert weights (casts, folded sites),
            expert GEMMs, expert SwiGLU, routing weights, combine (back to token order, the sum over
            k), aux losses, shared expert, output, grad accumulation; a backward operator takes the
            phase of the forward code that made its autograd node (anomaly mode records where each
            node was made)
  bytes     every tensor operand read once and every result written once: a byte model, not a trace
  host read an operator whose result sizes or values the host must read from the device before it
            can go on (torch's tags data_dependent_output and dynamic_output_shape, boolean indexing
            excepted integer indexing, repeat_interleave with its output_size given), and every
            tolist()
Eager counts: torch.compile (distributed.compile, the default) fuses element-wise operators, so a
compiled step launches fewer kernels and moves fewer bytes; the GEMMs, sorts and gathers stay.
Counts do not depend on the token count (the grouped path launches per layer, not per expert); bytes
grow linearly in it.
"""

import argparse
import ast
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import scalevec_train.model.moe as moe_module
import scalevec_train.model.swiglu as swiglu_module
from scalevec_train.config import compose_config
from scalevec_train.model.moe import MoEFeedForward
from scalevec_train.model.transformer import Transformer

HOST_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
# operators that allocate or relabel without running a kernel
NO_KERNEL = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
             torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.detach,
             torch.ops.aten.alias, torch.ops.aten.lift_fresh}
OURS = {Path(moe_module.__file__).resolve(): "moe",
        Path(swiglu_module.__file__).resolve(): "swiglu"}


@dataclass
class Op:
    name: str
    phase: str
    backward: bool
    bytes: int
    host_read: bool


@dataclass
class Account:
    ops: list[Op] = field(default_factory=list)
    # (phase, A shape, B shape)
    grouped_mm: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    tolist: int = 0

    def host_reads(self) -> list[str]:
        return [f"{o.name} ({o.phase}{', backward' if o.backward else ''})" for o in self.ops
                if o.host_read] + \
            ["tolist()"] * self.tolist


def _functions(path: Path) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function in a source file."""
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef):
                out.append((child.lineno, child.end_lineno, f"{prefix}{child.name}"))
                walk(child, f"{prefix}{child.name}.")
    walk(ast.parse(path.read_text()), "")
    return out


class _Source:
    """Qualified function names and line texts of model/moe.py and model/swiglu.py, by line."""

    def __init__(self):
        self.functions = {p: _functions(p) for p in OURS}
        self.lines = {p: p.read_text().splitlines() for p in OURS}

    def frame(self, path: Path, line: int) -> tuple[str, str, str] | None:
        """(module, innermost function, line text) of a line of ours, None for other files."""
        if path not in OURS:
            return None
        inner = [f for f in self.functions[path] if f[0] <= line <= f[1]]
        name = min(inner, key=lambda f: f[1] - f[0])[2] if inner else "<module>"
        return OURS[path], name, self.lines[path][line - 1]


def phase(frames: list[tuple[str, str, str]]) -> str:
    """The phase of an operator from the frames of ours that called it, innermost first."""
    names = [name for _, name, _ in frames]
    if "SharedExpert.forward" in names:
        return "shared expert"
    for module, name, text in frames:
        if name == "_expert_mm":
            return "expert GEMMs"
        if module == "swiglu":
            if name in ("fold_sites", "ExpertSwiGLU.folded_weights", "_vector"):
                return "expert weights"
            return "expert SwiGLU"
        if name == "MoEFeedForward.route":
            return "router"
        if name == "MoEFeedForward._record_aux":
            return "aux losses"
        if name == "RoutedExperts.compute":
            if "w.to(" in text or "folded" in text or "torch.cat" in text:
                return "expert weights"
            if "gates" in text:
                return "routing weights"
            return "routing"
        if name == "RoutedExperts.forward":
            return "combine" if "inverse" in text or ".sum(" in text else "dispatch"
        if name == "MoEFeedForward.forward":
            if "rms_norm_scales" in text or "y * s" in text or "x_router.dtype" in text:
                return "output"
            return "routing"
        if name == "sort_by_expert":
            return "routing"
    return "other"


def _stack_frames(source: _Source) -> list[tuple[str, str, str]]:
    frames, f = [], sys._getframe(2)
    while f is not None:
        found = source.frame(Path(f.f_code.co_filename).resolve(), f.f_lineno)
        if found:
            frames.append(found)
        f = f.f_back
    return frames


_TRACEBACK_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def _node_frames(source: _Source, node) -> list[tuple[str, str, str]]:
    frames = []
    for entry in reversed(node.metadata.get("traceback_", [])):
        m = _TRACEBACK_LINE.search(entry)
        if m:
            found = source.frame(Path(m.group(1)).resolve(), int(m.group(2)))
            if found:
                frames.append(found)
    return frames


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _host_read(func, args, kwargs) -> bool:
    if not any(t in func.tags for t in HOST_TAGS):
        return False
    if func is torch.ops.aten.index.Tensor:  # integer indices need no read; a boolean mask does
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


class Counter(TorchDispatchMode):
    """Records every operator that runs a kernel, with its phase, bytes and whether it reads the
    device."""

    def __init__(self, account: Account, source: _Source):
        super().__init__()
        self.account, self.source = account, source

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket in NO_KERNEL:
            return out
        node = torch._C._current_autograd_node()
        if node is None:
            where = phase(_stack_frames(self.source))
        elif type(node).__name__ == "AccumulateGrad":
            where = "grad accumulation"
        else:
            where = phase(_node_frames(self.source, node))
        self.account.ops.append(Op(func.name(), where, node is not None,
                                   _nbytes(args) + _nbytes(out), _host_read(func, args, kwargs)))
        if func is torch.ops.aten._grouped_mm.default:
            self.account.grouped_mm.append((where, tuple(args[0].shape), tuple(args[1].shape)))
        return out


def build_layer(preset: str, scale: str, backend: str) -> MoEFeedForward:
    """The first MoE layer of `preset` under `scale`, initialized as training initializes it."""
    cfg = compose_config([f"model={preset}", f"scale={scale}", f"model.moe.backend={backend}",
                          "model.n_layers=1"], 1)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=0)
    return model.layers[0].ffn.train()


def account(layer: MoEFeedForward, tokens: int) -> Account:
    """Counts one forward and backward of `layer` on `tokens` tokens (bf16 autocast, CPU)."""
    dim, experts = layer.router.weight.shape[1], layer.cfg.num_experts
    gen = torch.Generator().manual_seed(1)
    # the pre-norm's outputs, in the residual stream's dtype under autocast (model/transformer.py)
    branches = {b: torch.randn(1, tokens, dim, generator=gen).bfloat16().requires_grad_()
                for b in set(layer.reads)}
    # balanced routing: the bias cancels the router's mean preference over these tokens
    with torch.no_grad():
        x = branches[layer.reads[0]].reshape(-1, dim)
        layer.expert_bias.copy_(1.0 / experts - layer.route(x)[1].mean(0))
    probe, one = torch.randn(1, tokens, dim, generator=gen).bfloat16(), torch.ones(())
    result, source, original_tolist = Account(), _Source(), torch.Tensor.tolist

    def tolist(t):
        result.tolist += 1
        return original_tolist(t)

    torch.Tensor.tolist = tolist
    try:
        with torch.autograd.detect_anomaly(check_nan=False), Counter(result, source):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(branches)
            # the backward from the layer's outputs themselves: no operator of a loss is counted
            outputs = [y] if layer.aux_loss is None else [y, layer.aux_loss]
            torch.autograd.backward(outputs, [probe, one][:len(outputs)])
    finally:
        torch.Tensor.tolist = original_tolist
    return result


PHASES = ["router", "routing", "aux losses", "dispatch", "expert weights", "expert GEMMs",
          "expert SwiGLU", "routing weights", "combine", "shared expert", "output",
          "grad accumulation", "other"]


def table(results: dict[str, Account], tokens: int) -> str:
    lines = [f"| phase | {' | '.join(f'{s} fwd ops | {s} bwd ops | {s} MB' for s in results)} |",
             "|---|" + "---|" * (3 * len(results))]
    per = {}
    for s, acc in results.items():
        d = defaultdict(lambda: [0, 0, 0])
        for o in acc.ops:
            d[o.phase][1 if o.backward else 0] += 1
            d[o.phase][2] += o.bytes
        per[s] = d
    for p in PHASES + ["all"]:
        cells = []
        for s in results:
            if p == "all":
                f, b, m = (sum(v[i] for v in per[s].values()) for i in range(3))
            else:
                f, b, m = per[s].get(p, (0, 0, 0))
            cells += [str(f), str(b), f"{m / 1e6:,.0f}"]
        if p == "all" or any(c != "0" for c in cells):
            lines.append(f"| {p} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="moe-2b")
    p.add_argument("--scales", default="baseline,unified")
    p.add_argument("--tokens", type=int, default=16384,
                   help="tokens of the micro-batch (moe-2b's recipe: 8 x 2048)")
    p.add_argument("--backend", default="auto", help="model.moe.backend: auto | grouped_mm | loop")
    args = p.parse_args()
    torch.set_grad_enabled(True)
    results = {s: account(build_layer(args.preset, s, args.backend), args.tokens)
               for s in args.scales.split(",")}
    print(f"{args.preset}, one MoE layer, {args.tokens} tokens, bf16 autocast, torch "
          f"{torch.__version__} (CPU), backend {args.backend}: operators that run a kernel, "
          "forward and backward, and bytes moved (MB)\n")
    print(table(results, args.tokens))
    for s, acc in results.items():
        reads = acc.host_reads()
        print(f"\n{s}: {len(reads)} host reads{': ' + ', '.join(reads) if reads else ''}")
        shapes = defaultdict(int)
        for _, a, b in acc.grouped_mm:
            shapes[(a, b)] += 1
        print(f"{s}: {len(acc.grouped_mm)} grouped GEMMs: " +
              "; ".join(f"{n} x {list(a)} by {list(b)}" for (a, b), n in shapes.items()))


if __name__ == "__main__":
    main()

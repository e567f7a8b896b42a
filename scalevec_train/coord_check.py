"""`python -m scalevec_train.coord_check [overrides...] [widths=1,2,4,8,16] [depths=1,2,4,8]
[steps=4] [grow=heads] [bound=0.25] [out=coord_check]`: does the parameterization keep every
coordinate's update the same size as the model grows? (docs/concepts/parameterization.md, "The
coordinate check").

The model the overrides compose (model, scale, optim, model.parameterization, optim.lr, ...) is the
base: it is trained at `widths` times its width (dim, ffn_dim, expert widths; `grow=heads` adds
heads of the same width, `grow=head_dim` widens its heads) at its own depth, and at `depths` layers
at its own width, each for `steps` optimizer steps at the constant peak LR on the same synthetic
batches (a fixed random bigram language: learnable, no data to prepare). After the last step it
measures, against the same model at initialization on a probe batch:

    layer<i>         RMS of the change of block i's output (the residual stream after it)
    attention<i>     RMS of the change of block i's attention logits (scaled q.k over the causal
                     pairs)
    logits           RMS of the change of the output logits
    update:<param>   each matrix's update in the spectral condition's units, ||m dW||_2
                     sqrt(fan_in / fan_out) (m: a readout's multiplier of its output, 1 for the
                     others; the embedding read as a map from tokens). The depth rule's residual
                     multiplier is left out on purpose: it makes each block's share of the stream's
                     change 1 / depth, while its matrices' own updates, and the stream's change in
                     all, stay the same size

muP (and CompleteP for depth) keeps every one of them the same size at every width (depth); sp does
not: under Adam a hidden matrix's update grows with the width. Each quantity's log-log slope against
width (and against depth: the logits, each kind of matrix and, from depth 2 on, the last block's) is
fitted by least squares; the check fails, exit 1, when a slope exceeds `bound` (growth: 0 under mup,
at least 0.5 for sp's hidden activations and updates under Adam or Muon, about 1 for its logits) or
falls below -0.5 (an update that vanishes with the size; at small sizes a quantity under mup may
shrink, but no faster than the n^-1/2 of the initialization's share in it, e.g. the logits' W_0
dh / m_N). It writes OUT/table.md (values, slopes, verdicts) and, with matplotlib, OUT/plot.png.
"""

import copy
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from scalevec_train.config import to_config
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.config import ModelConfig, ScaleConfig
from scalevec_train.model.parameterization import Kind
from scalevec_train.model.transformer import Transformer
from scalevec_train.optim.config import OptimConfig
from scalevec_train.optim.groups import build_optimizer
from scalevec_train.run import cli

FLOOR = -0.5  # the steepest shrinking a quantity may show (see the docstring)


@dataclass(frozen=True)
class Options:
    widths: tuple[int, ...] = cli.option("the multiples of the base model's width trained",
                                         (1, 2, 4, 8, 16))
    depths: tuple[int, ...] = cli.option("the depths (blocks) trained at the base width",
                                         (1, 2, 4, 8))
    steps: int = cli.option("optimizer steps of each model", 4)
    grow: str = cli.option("heads (more heads of the same width) or head_dim (wider heads)",
                           "heads")
    bound: float = cli.option("the largest slope that passes", 0.25)
    out: Path = cli.option("the folder of table.md and plot.png", Path("coord_check"))
    seed: int = cli.option("seeds the models and the synthetic batches", 0)
    batch: int = cli.option("sequences per batch", 4)
    seq: int = cli.option("tokens per sequence", 32)

    def __post_init__(self) -> None:
        if (len(set(self.widths)) < 2 or min(self.widths) < 1 or min(self.depths) < 1
                or len({d for d in self.depths if d >= 2}) < 2):
            raise ScalevecError("widths/depths", "a slope needs at least two different positive "
                                "sizes (the last block's against depth: two of 2 layers or more).",
                                "give e.g. widths=1,2,4,8,16 depths=1,2,4,8.")
        if self.grow not in ("heads", "head_dim"):
            raise ScalevecError("grow", f"unknown value {self.grow!r}.",
                                "use grow=heads or grow=head_dim.")
        if self.steps < 1 or self.bound <= 0 or self.batch < 1 or self.seq < 2:
            raise ScalevecError("steps/bound/batch/seq", "must be positive (seq at least 2).",
                                "give steps=4 bound=0.25 batch=4 seq=32.")


def shaped(base: ModelConfig, width: int, layers: int, grow: str) -> ModelConfig:
    """The base model `width` times as wide with `layers` blocks; its parameterization's base shape
    is the base model (sp has none)."""
    moe = base.moe and dataclasses.replace(
        base.moe, expert_dim=base.moe.expert_dim * width,
        shared_expert_dim=base.moe.shared_expert_dim and base.moe.shared_expert_dim * width)
    heads = 1 if grow == "head_dim" else width
    out = dataclasses.replace(base, dim=base.dim * width, ffn_dim=base.ffn_dim * width,
                              n_layers=layers, moe=moe, n_heads=base.n_heads * heads,
                              n_kv_heads=base.n_kv_heads * heads)
    if base.parameterization == "mup":
        out = dataclasses.replace(out, base_dim=base.dim, base_layers=base.n_layers,
                                  base_head_dim=base.head_dim)
    return out


def batches(vocab: int, batch: int, seq: int, count: int, seed: int) -> list[torch.Tensor]:
    """Token batches of a fixed random bigram language: each token's successor drawn from 4 of the
    vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    out = []
    for _ in range(count):
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(1, seq):
            tokens[:, t] = successors[tokens[:, t - 1],
                                      torch.randint(0, 4, (batch,), generator=gen)]
        out.append(tokens)
    return out


def _observe(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each block's output, each block's attention logits (causal pairs) and the output logits."""
    seen, hooks = {}, []
    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(f"layer{i}", out.x if out.plus is None
                                                      else out.x + out.plus)))
        for name in ("wq", "wk"):
            hooks.append(getattr(block.attn, name).register_forward_hook(
                lambda _m, _a, out, i=i, name=name: seen.__setitem__(f"{name}{i}", out)))
    try:
        with torch.no_grad():
            seen["logits"] = model(tokens).float()
    finally:
        for h in hooks:
            h.remove()
    batch, seq = tokens.shape
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for i, block in enumerate(model.layers):
        attn = block.attn
        q = seen.pop(f"wq{i}").view(batch, seq, attn.n_heads, attn.head_dim).transpose(1, 2)
        k = seen.pop(f"wk{i}").view(batch, seq, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
        k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
        scale = attn.scale if attn.scale is not None else attn.head_dim**-0.5
        seen[f"attention{i}"] = ((model.rope(q) @ model.rope(k).transpose(-1, -2))
                                 * scale)[..., causal]
    return seen


def _spectral(w: torch.Tensor) -> torch.Tensor:
    """Each matrix's largest singular value (a stack: the RMS over its matrices)."""
    s = torch.linalg.matrix_norm(w.float(), ord=2)
    return s.square().mean().sqrt() if s.dim() else s


def _updates(model: Transformer, start: dict[str, torch.Tensor]) -> dict[str, float]:
    p = model.parameterization
    sites = model.plan.site_parameters()
    out = {}
    for name, w in model.named_parameters():
        kind = p.kind(name, sites)
        if kind is Kind.VECTOR:
            continue
        dw = w.detach() - start[name]
        fan_out, fan_in = w.shape[-2], w.shape[-1]
        if kind is Kind.EMBEDDING:  # a map from tokens: [vocab, dim] is its transpose
            out[f"update:{name}"] = float(_spectral(dw) * math.sqrt(fan_out / fan_in))
            if model.head is None:  # the tied readout
                out["update:readout (tied)"] = float(_spectral(dw * p.readout)
                                                     * math.sqrt(fan_in / fan_out))
            continue
        m = p.readout if kind is Kind.READOUT else 1.0
        out[f"update:{name}"] = float(_spectral(dw * m) * math.sqrt(fan_in / fan_out))
    return out


def measure(model_cfg: ModelConfig, scale_cfg: ScaleConfig, optim_cfg: OptimConfig,
            o: Options) -> dict[str, float]:
    """Every quantity of the module docstring for one model after o.steps steps."""
    torch.manual_seed(o.seed)
    model = Transformer(model_cfg, scale_cfg)
    model.init_weights(o.seed)
    start = {n: w.detach().clone() for n, w in model.named_parameters()}
    train = batches(model_cfg.vocab_size, o.batch, o.seq, o.steps + 1, o.seed)
    probe = train.pop()
    model.eval()
    before = _observe(model, probe)
    model.train()
    optimizer = build_optimizer(model, optim_cfg)
    for g in optimizer.param_groups:
        # the constant peak LR: the check is about one step's size, not a schedule
        g["lr"] = g["base_lr"]
    for tokens in train:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        extra = model.auxiliary_loss()
        (loss if extra is None else loss + extra).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_after_step()
    model.eval()
    after = _observe(model, probe)
    out = {k: float((after[k] - before[k]).float().pow(2).mean().sqrt()) for k in before}
    out.update(_updates(model, start))
    return out


def slope(sizes: list[float], values: list[float]) -> float:
    """The least-squares slope of log(value) against log(size)."""
    x = [math.log(s) for s in sizes]
    y = [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return (sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
            / sum((a - mx) ** 2 for a in x))


def _by_depth(values: dict[str, float], layers: int) -> dict[str, float]:
    """The quantities that mean the same at every depth: the logits, each kind of matrix's update
    (RMS over the blocks) and, from 2 layers on, the last block's. One layer's last block is the
    first, which reads the embedding instead of the residual stream, and its change is not the later
    blocks' (at dense-tiny's shape its attention logits move half as much: docs/parameterization.md,
    "The coordinate check")."""
    out = {} if layers == 1 else {"layer(last)": values[f"layer{layers - 1}"],
                                  "attention(last)": values[f"attention{layers - 1}"]}
    out["logits"] = values["logits"]
    kinds: dict[str, list[float]] = {}
    for k, v in values.items():
        if k.startswith("update:"):
            parts = k.split(".")
            key = "update:" + ".".join(parts[2:]) if parts[0] == "update:layers" else k
            kinds.setdefault(key, []).append(v)
    out.update({k: math.sqrt(sum(v * v for v in vs) / len(vs)) for k, vs in kinds.items()})
    return out


@dataclass
class Sweep:
    axis: str  # width | depth
    sizes: list[int]
    # quantity -> size -> value, at the sizes that have the quantity
    values: dict[str, dict[int, float]]

    @classmethod
    def of(cls, axis: str, sizes: list[int], runs: list[dict[str, float]]) -> "Sweep":
        """runs: each size's quantities; the run with the most of them has them all, in the table's
        order."""
        keys = max(runs, key=len)
        return cls(axis, sizes, {k: {n: r[k] for n, r in zip(sizes, runs, strict=True) if k in r}
                                 for k in keys})

    def slopes(self) -> dict[str, float]:
        return {k: slope(list(v), list(v.values())) for k, v in self.values.items()}


def run(cfg, o: Options) -> tuple[Sweep, Sweep]:
    base = cfg.model
    width_runs = [measure(shaped(base, w, base.n_layers, o.grow), cfg.scale, cfg.optim, o)
                  for w in o.widths]
    depth_runs = [_by_depth(measure(shaped(base, 1, d, o.grow), cfg.scale, cfg.optim, o), d)
                  for d in o.depths]
    return (Sweep.of("width", [base.dim * w for w in o.widths], width_runs),
            Sweep.of("depth", list(o.depths), depth_runs))


def table(sweeps: tuple[Sweep, ...], bound: float, title: str) -> tuple[str, list[str]]:
    lines, failed = [f"# Coordinate check: {title}", "",
                     f"Change since initialization after the last step; the check: {FLOOR:g} <= "
                     f"slope <= {bound:g}.",
                     ""], []
    for s in sweeps:
        lines += [f"## Against {s.axis}", "",
                  "| quantity | " + " | ".join(f"{s.axis} {n}" for n in s.sizes)
                  + " | slope | |", "|---|" + "---:|" * (len(s.sizes) + 1) + "---|"]
        for k, sl in s.slopes().items():
            ok = FLOOR <= sl <= bound
            if not ok:
                failed.append(f"{s.axis}: {k} (slope {sl:+.2f})")
            row = [f"{s.values[k][n]:.3g}" if n in s.values[k] else "-" for n in s.sizes]
            lines.append(f"| {k} | " + " | ".join(row) + f" | {sl:+.2f} | "
                         + ("ok" if ok else "FAIL") + " |")
        lines.append("")
    return "\n".join(lines), failed


def plot(sweeps: tuple[Sweep, ...], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = ("layer", "attention", "logits", "update:")
    fig, axes = plt.subplots(len(sweeps), len(groups), figsize=(4 * len(groups), 3.2 * len(sweeps)),
                             squeeze=False)
    for row, s in zip(axes, sweeps, strict=True):
        for ax, group in zip(row, groups, strict=True):
            for k, v in s.values.items():
                if k.startswith(group):
                    ax.plot(list(v), list(v.values()), marker="o", linewidth=1,
                            label=k.removeprefix("update:"))
            ax.set(xscale="log", yscale="log", xlabel=s.axis,
                   title=f"{group.rstrip(':')} against {s.axis}")
            if group == "update:" and len(ax.lines) <= 12:
                ax.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def check(o: Options, raw) -> int:
    cfg = to_config(raw)
    title = (f"{cfg.model.name} {cfg.scale.name} {cfg.optim.name} lr {cfg.optim.lr:g}, "
             f"parameterization {cfg.model.parameterization}")
    sweeps = run(copy.deepcopy(cfg), o)
    o.out.mkdir(parents=True, exist_ok=True)
    text, failed = table(sweeps, o.bound, title)
    (o.out / "table.md").write_text(text)
    drawn = plot(sweeps, o.out / "plot.png", title)
    print(text)
    print(f"wrote {o.out / 'table.md'}" + (f" and {o.out / 'plot.png'}" if drawn else
                                          " (no plot: matplotlib is not installed; pip install -e "
                                          "'.[analysis]')"))
    if failed:
        print(f"coordinate check FAILED: {len(failed)} slope(s) outside [{FLOOR:g}, {o.bound:g}]: "
              + "; ".join(failed), file=sys.stderr)
        return 1
    print(f"coordinate check passed: every slope within [{FLOOR:g}, {o.bound:g}]")
    return 0


def main(argv: list[str]) -> int:
    return cli.main(argv, Options, check, overrides=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

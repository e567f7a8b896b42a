"""Compare training runs (local run directories and/or wandb runs); see --help."""

import argparse
import sys

from scalevec_analysis import (
    ema_run,
    load_run_dir,
    load_wandb,
    write_comparison,
    write_diagnostics,
    write_efficiency,
    write_scaling,
)
from scalevec_train.infra.errors import ScalevecError

DESCRIPTION = """\
Groups runs by their resolved config minus the seed and bookkeeping (run_dir, resume, branch_from,
logger.*, checkpoint.*, tasks.*, data.cache_dir, path-like keys; more with --ignore) and compares
the groups. A WSD branch's run directory holds its trunk's records up to the branch point, so
branches and their trunk overlay as runs of their own lengths. An averaged checkpoint folder
evaluated by scalevec_train.evaluate is a run of its own (averaged=<steps>, or averaged=ema@<step>
for a run's weight EMA written out), and --weight-ema adds the validation curve of each run's
weight EMA (val_loss_ema, train.ema.*) as a run of its own (ema=half-life <tokens>).

Default mode writes OUT/curves.png (loss and validation loss against tokens), OUT/summary.md and
OUT/summary.csv, and prints the table:
  terminal loss   per run: the final val_loss (--metric val_loss) or val_bpb (--metric val_bpb,
                  bits per byte of the text: runs of different tokenizers compare), or those of
                  one source of a data mixture (--metric val_loss/NAME, val_bpb/NAME), or the mean
                  of the last --last-k logged training losses (--metric loss); per group: mean and
                  sample std (ddof=1) over its runs (seeds). T_G: mean tokens at the runs'
                  terminal points.
  Δ vs ref        group terminal loss minus the reference group's.
  token efficiency  T_R / T_G, where T_R is the first token count at which the reference's curve
                  (mean over its seeds, linear in tokens; for `loss` each point is the trailing
                  mean of --last-k values) reaches the group's terminal loss, interpolated
                  linearly between logged points. >1: the group needs fewer tokens than the
                  reference for that loss. "not reached" when the reference never gets that low.
  task columns    where runs scored downstream tasks (tasks=...): each task's final acc and
                  acc_norm (mean over the group's runs; the header gives the chance level);
                  summary.csv adds bpb and chance (task/<name>/<metric>).

--scaling mode fits L(N) = E + A*N^(-alpha), E >= 0, per strategy (runs split by the config keys
under --series, default the `scale` section) to the mean terminal loss at each parameter count N
(describe.json total_params, else `params` in the metrics), and writes OUT/scaling.png,
OUT/scaling.md and OUT/scaling.csv.

--efficiency mode measures compute efficiency against --reference over a ladder: runs split into
series (--series, default `scale`) and, within a series, into points (everything else but the
seed: model size, budget); C = train_flops_per_token (describe.json) times tokens. A point's
compute multiplier is the compute the reference needs to reach the point's loss over the point's
compute (>1: the strategy needs less), read two ways:
  from ref's curves  seed by seed, against every evaluation of the reference's runs of that seed
                  on the same rung (the point's config without train.steps,
                  train.tokens_per_param and schedule.*: a trunk and its WSD branches): where
                  their lower envelope (running minimum of the loss as compute grows, log-linear
                  in compute) first gets to the run's terminal loss; "> x" when the reference
                  never gets there within its longest budget, "<= x" when it is there at its
                  first evaluation; per point the geometric mean over seeds.
  from ref's law  each series fitted with L(C) = E + A*C^(-alpha), E >= 0, over all its points;
                  the compute at which the reference's law reaches the point's mean loss (at the
                  loss) or the strategy's law at the point's compute (at the strategy's law); 95%
                  percentile bootstrap intervals over seeds (--bootstrap resamples).
Both per point and as the geometric mean over a series' points, with the laws' residuals (loss -
law). Pass trunks and branches together. Writes OUT/efficiency.png, OUT/efficiency.md and
OUT/efficiency.csv; docs/guides/experiments.md ("Compute efficiency") says which to read when they
disagree.

--diagnostics mode draws the diag/* metrics of runs trained with train.diagnostics_every
(docs/guides/experiments.md, "Diagnostics") over training, a column per run (e.g. baseline against
unified), to OUT/diagnostics.png: the training loss; the residual stream's RMS and the largest
attention logit per layer; per kind of linear map (mean over the layers) the update-to-weight
ratio, the gain of the input-side scale on the column norms, the spread of the column norms of
W diag(g) and of W, the kurtosis and max / RMS of its input, and under model.fp8 the share of that
input its FP8 cast flushes to 0 and the SNR of its FP8 weight gradient against bf16's.
"""


def metric_name(value: str) -> str:
    """--metric: loss, val_loss, val_bpb, or one of the last two of a mixture's source
    (val_loss/NAME)."""
    base, _, source = value.partition("/")
    if value in ("loss", "val_loss", "val_bpb") or (base in ("val_loss", "val_bpb") and source):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not loss, val_loss, val_bpb, val_loss/NAME "
                                     "or val_bpb/NAME")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="trainer run directories")
    p.add_argument("--wandb", action="append", default=[], metavar="ENTITY/PROJECT/RUN_ID",
                   help="a wandb run to include (repeatable)")
    p.add_argument("--wandb-filter", action="append", default=[], metavar="SPEC",
                   help="""wandb runs matching ENTITY/PROJECT:{"config.scale.name": "unified"} """
                        "(JSON passed to wandb.Api().runs as filters; repeatable)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--reference",
                   help="reference group (--efficiency: series): its label or key=value terms, "
                        "e.g. 'scale=baseline' (required unless --scaling)")
    p.add_argument("--metric", type=metric_name, default="val_loss",
                   help="the loss that defines terminal loss and token efficiency (default "
                        "val_loss; val_bpb: validation bits per byte, which compares runs of "
                        "different tokenizers; val_loss/NAME or val_bpb/NAME: those of source NAME "
                        "of a data mixture)")
    p.add_argument("--last-k", type=int, default=10,
                   help="--metric loss: average the last K logged training losses (default 10)")
    p.add_argument("--ema", type=float,
                   help="plot only: smooth training-loss curves with this EMA factor")
    p.add_argument("--weight-ema", action="store_true",
                   help="also compare each run's weight EMA (its val_loss_ema curve) as a "
                        "run of its own")
    p.add_argument("--logx", action="store_true", help="log-scale tokens axis")
    p.add_argument("--logy", action="store_true", help="log-scale loss axis")
    p.add_argument("--ignore", action="append", default=[], metavar="KEY",
                   help="also ignore this config key or section when grouping (repeatable)")
    p.add_argument("--scaling", action="store_true",
                   help="fit L(N) = E + A*N^(-alpha) per strategy")
    p.add_argument("--series", action="append", metavar="KEY",
                   help="--scaling, --efficiency: config keys or sections that define a strategy "
                        "(default: scale)")
    p.add_argument("--efficiency", action="store_true",
                   help="compute multipliers of each strategy against --reference over a ladder")
    p.add_argument("--diagnostics", action="store_true",
                   help="draw the runs' diag/* metrics side by side (OUT/diagnostics.png)")
    p.add_argument("--extrapolate", action="append", default=[], metavar="MODEL",
                   help="--efficiency: carry each strategy's pooled trend (OUT/trend.md) to this "
                        "model preset with the runs' sequence length and vocabulary, at each of "
                        "--budgets: an extrapolation, written as one (repeatable)")
    p.add_argument("--budgets", type=float, nargs="+", default=[2.5, 5.0], metavar="TPP",
                   help="--extrapolate: the tokens per parameter to extrapolate at (default 2.5 5)")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="--efficiency: bootstrap resamples over seeds for the law's intervals "
                        "(default 1000)")
    args = p.parse_args(argv)
    if not (args.run_dirs or args.wandb or args.wandb_filter):
        p.error("give at least one RUN_DIR, --wandb or --wandb-filter")
    if sum((args.scaling, args.efficiency, args.diagnostics)) > 1:
        p.error("--scaling, --efficiency and --diagnostics are separate modes: pick one")
    if not (args.scaling or args.diagnostics) and not args.reference:
        p.error("--reference is required (unless --scaling or --diagnostics)")
    if args.last_k < 1:
        p.error("--last-k must be at least 1")
    if args.bootstrap < 1:
        p.error("--bootstrap must be at least 1")
    if args.ema is not None and not 0.0 <= args.ema < 1.0:
        p.error("--ema must be in [0, 1)")
    return args


def ladder_compute(model: str, budget: float, runs) -> float:
    """The training compute of the model preset at `budget` tokens per parameter with the runs'
    sequence length and vocabulary: its training FLOPs per token there times budget x N."""
    import torch

    from scalevec_train.config import compose_config
    from scalevec_train.costs.accounting import train_flops_per_token
    from scalevec_train.model.transformer import Transformer

    shapes = {(r.config.get("train.seq_len"), r.config.get("model.vocab_size")) for r in runs}
    if len(shapes) != 1:
        raise ScalevecError("--extrapolate", f"the runs differ in sequence length or vocabulary "
                            f"({sorted(shapes)}).",
                            "extrapolate a ladder whose runs share train.seq_len and "
                            "model.vocab_size.")
    (seq_len, vocab), = shapes
    cfg = compose_config([f"model={model}", f"model.vocab_size={vocab}",
                          f"train.seq_len={seq_len}"])
    with torch.device("meta"):
        flops = train_flops_per_token(Transformer(cfg.model, cfg.scale), seq_len)
    return flops * budget * cfg.model.non_embedding_params()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [load_run_dir(d) for d in args.run_dirs]
        if args.wandb or args.wandb_filter:
            runs += load_wandb(args.wandb, args.wandb_filter)
        if args.weight_ema:
            runs += [e for e in map(ema_run, runs) if e is not None]
        if args.scaling:
            table = write_scaling(runs, args.out, args.metric, args.last_k,
                                  args.series or ["scale"], args.ignore)
        elif args.diagnostics:
            table = write_diagnostics(runs, args.out, args.ignore)
        elif args.efficiency:
            at = [(m, ladder_compute(m, b, runs), b)
                  for m in args.extrapolate for b in args.budgets]
            table = write_efficiency(runs, args.reference, args.out, args.metric, args.last_k,
                                     args.series or ["scale"], args.ignore, args.bootstrap, at)
        else:
            table = write_comparison(runs, args.reference, args.out, args.metric, args.last_k,
                                     args.ema, args.logx, args.logy, args.ignore)
    except ScalevecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

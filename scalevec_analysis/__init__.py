"""Compare training runs: load them, group them by config minus the seed, measure the differences,
fit scaling laws. Kept out of `scalevec_train` so that training does not need matplotlib, which only
the plots use (`pip install -e ".[analysis]"`).

Modules: `runs` reads run directories and wandb runs, `groups` groups them and summarizes the
groups, `scaling` fits the scaling law, `efficiency` measures compute multipliers over a ladder
(`envelope` reads them from the reference's curves), `plots` draws, `report` writes an output
directory, `diagnostics` reads the diagnostics' series (diag/* metrics).

Definitions (the CLI's --help repeats them):

- A run's *metric curve* is (tokens, value) at each logged step that has the metric. For `val_loss`
  the value is the logged validation loss, for `val_bpb` the same loss in bits per byte of the text
  (comparable across tokenizers). For `loss` (training loss, which is noisy) the value at a
  point is the mean of the last `last_k` logged losses up to and including it (fewer at the start).
- A run's *terminal loss* is the last point of its metric curve: the final validation loss, or the
  mean of the last `last_k` logged training losses. The run's *tokens* are the tokens at that point.
- A *group* is the runs whose configs agree on every key except the seed and bookkeeping (see
  `groups.is_ignored`). Its terminal loss is the mean over its runs, with their sample standard
  deviation (ddof=1; NaN for a single run). Its tokens T_G are the mean of its runs' tokens.
- A group's *curve* is the mean over its runs of their metric curves, each interpolated linearly in
  tokens at the union of their token points, within the token range that all of them cover.
- The *token efficiency* of group G against the reference group R is T_R / T_G, where T_R is the
  first token count at which R's curve reaches G's terminal loss (value <= it), interpolated
  linearly in tokens between the two logged points around the crossing (T_R is R's first token count
  if its first point is already low enough). >1 means G reaches its loss with fewer tokens than R
  needs for it. When R's curve never gets that low, T_R and the efficiency are "not reached" (None).
- The *compute multiplier* of a strategy at a ladder point is the training compute (FLOPs per token
  times tokens) the reference needs to reach the point's terminal loss, divided by the point's
  compute. >1: the strategy needs less compute for that loss. It is read from the reference's
  measured curves on the same rung, seed by seed (`envelope`: their lower envelope, a bound where
  the reference never gets there), and from the reference's fitted law L(C) = E + A C^(-alpha),
  E >= 0 (`efficiency` has the details).
"""

from scalevec_analysis.efficiency import compute_efficiency, efficiency_series, reference_compute
from scalevec_analysis.grouping import (
    ema,
    find_group,
    first_reach,
    group_runs,
    metric_curve,
    summarize,
)
from scalevec_analysis.report import (
    write_comparison,
    write_diagnostics,
    write_efficiency,
    write_scaling,
)
from scalevec_analysis.runs import (
    Run,
    ema_run,
    load_run_dir,
    load_wandb,
    merge_records,
    parse_wandb_filter,
    run_from_history,
)
from scalevec_analysis.scaling import fit_power_law, scaling_series

__all__ = ["Run", "compute_efficiency", "efficiency_series", "ema", "ema_run", "find_group",
           "first_reach", "fit_power_law", "group_runs", "load_run_dir", "load_wandb",
           "merge_records", "metric_curve", "parse_wandb_filter", "reference_compute",
           "run_from_history", "scaling_series", "summarize", "write_comparison",
           "write_diagnostics", "write_efficiency", "write_scaling"]

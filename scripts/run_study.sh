#!/usr/bin/env bash
# The CPU reproduction study (docs/results/README.md): every arm's sweep, then one comparison per
# claim.
#   bash scripts/run_study.sh            the main study (from the repository root, after
#                                        `make setup`)
#   bash scripts/run_study.sh lr_sweep   the supplementary learning-rate sweep (reuses the main
#                                        study's lr 3e-3 runs: run the main study first)
#   bash scripts/run_study.sh ladder     the ladder at 10 tokens per parameter
#                                        (configs/experiment/ladder.yaml): an LR grid on dense-l2,
#                                        then dense-l1..l3 x baseline, unified x AdamW, Muon x 3
#                                        seeds with WSD branches, and the 5x-budget check; runs to
#                                        runs/ladder/, tables to docs/results/ladder/
#   bash scripts/run_study.sh adamw_l3   why unified loses to the baseline under AdamW at dense-l3:
#                                        per-site LR and decay, IWD's strength and reach, a
#                                        leave-one-out, the mirror under Muon, the AdamW ladder
#                                        again with optim.scale_lr=0.01 and dense-l1 at swapped LRs
#                                        (3 seeds each, trunks to 10 tokens per parameter); runs to
#                                        runs/adamw_l3/, tables to docs/results/adamw_l3/
#   bash scripts/run_study.sh lr_ladder  the ladder at each arm's own best LR per rung, and under
#                                        model.parameterization=mup (issue 47): AdamW's grid on
#                                        dense-l1..l3 (sites at optim.scale_lr=0.01; 2 seeds, a
#                                        third where needed; the sites' LR either side of the pick),
#                                        then 3 seeds with WSD branches at each pick; the grid under
#                                        mup and its ladder tuned on dense-l1, checked on dense-l4;
#                                        Muon's grids on one seed (scripts/lr_grid.py); runs to
#                                        runs/lr_ladder/, tables to docs/results/lr_ladder/
#   bash scripts/run_study.sh scaling    does unified's gain grow with scale? The AdamW ladder at
#                                        each arm's own best LR on dense-l4, dense-l6 and moe-l2..l4
#                                        (3 seeds; dense-l6 2, a third last); runs to runs/scaling/,
#                                        tables to docs/results/scaling/, each finished run's record
#                                        to docs/results/scaling/runs/ (the study resumes from them
#                                        on a fresh clone)
#   bash scripts/run_study.sh fp8        what scale vectors do to low precision: baseline and
#                                        unified at dense-l3 in bf16, FP8 tensorwise and rowwise
#                                        (every map in FP8), 3 seeds, with unified's ablations (no
#                                        gate/up output sites, plain sites, one site per norm); runs
#                                        to runs/fp8/, tables to docs/results/fp8/, each finished
#                                        run's record to docs/results/fp8/runs/ (as scaling's)
#   bash scripts/run_study.sh ladder_grid_l3 ["adamw muon"]  the ladder's LR grid again on
#                                        dense-l3 (both strategies of the optimizers named, seed 0),
#                                        then each arm at its dense-l3 pick with 3 seeds (trunks),
#                                        to docs/results/ladder/{lr_grid_l3,terminal_l3_picks}.md
# Two workers, one CPU thread each, take the sweeps from a queue, longest first (Muon's bf16
# Newton-Schulz makes its runs about twice as long on a CPU), so both cores stay busy to the end;
# the same seeds give the same numbers on the same machine whichever worker runs them. Finished runs
# are reused (resume=auto), so an interrupted study continues where it stopped. Runs go to
# runs/study/, each sweep's log to runs/study_logs/, comparisons (curves.png, summary.md,
# summary.csv) to docs/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
R=runs/study
compare() {  # name reference run-dirs...
  local name=$1 ref=$2
  shift 2
  $PY scripts/compare_runs.py "$@" --reference "$ref" --out docs/results/$name
}
sweeps() {  # one Hydra sweep per argument (its overrides, separated by spaces), on two workers
  mkdir -p runs/study_logs
  local i=0 sweep
  for sweep in "$@"; do
    i=$((i + 1))
    printf '%02d %s\n' $i "$sweep"
  done | xargs -L 1 -P 2 \
    bash -c '"$0" -m scalevec_train.train -m "${@:2}" > "runs/study_logs/$1.log" 2>&1 ||
    { echo "error: sweep $1 (${*:2}) failed; its log: runs/study_logs/$1.log" >&2; exit 1; }' "$PY"
}

# The ladder (docs/results/compute-multiplier-ladder.md). A rung's batch (sequences of 128 tokens)
# grows with it, its validation is the same 128 sequences on every rung, and it evaluates about 20
# times per trunk; l2 and l3 run compiled blocks (faster on a CPU from there on; l1's runs are
# shorter than the compilation).
rung_args() {
  case $1 in
    dense-l1) echo train.global_batch=4 train.eval_batches=32 train.eval_every=13 distributed.compile=false ;;
    dense-l2) echo train.global_batch=8 train.eval_batches=16 train.eval_every=52 distributed.compile=true ;;
    dense-l3) echo train.global_batch=16 train.eval_batches=8 train.eval_every=88 distributed.compile=true ;;
    dense-l4|moe-l4) echo train.global_batch=32 train.eval_batches=4 train.eval_every=104 distributed.compile=true ;;
    dense-l6) echo train.global_batch=64 train.eval_batches=2 train.eval_every=175 distributed.compile=true ;;
    moe-l2) echo train.global_batch=8 train.eval_batches=16 train.eval_every=52 distributed.compile=true ;;
    moe-l3) echo train.global_batch=16 train.eval_batches=8 train.eval_every=88 distributed.compile=true ;;
  esac
}
ladder_run() {  # rung scale optim lr seed [trunk]: the WSD trunk to 10 tokens per parameter, then
                # (unless "trunk") its branches decaying to 2.5 and 5 from its checkpoints at 2 and
                # 4; in the folder LADDER (runs/ladder), each run with the overrides LADDER_ARGS
                # (none) added
  local root=${LADDER:-runs/ladder}
  local args="+experiment=ladder model=$1 scale=$2 optim=$3 optim.lr=$4 seed=$5 \
$(rung_args "$1") ${LADDER_ARGS:-}"
  local name=$1-$2-$3-lr$4 log=${root}_logs/$1-$2-$3-lr$4-s$5.log
  mkdir -p ${root}_logs
  ($PY -m scalevec_train.train $args run_dir=$root/$name-tpp10.0-s$5 && { test "${6:-}" = trunk ||
    for budget in 2.5 5.0; do
      $PY -m scalevec_train.train $args train.tokens_per_param=$budget \
        run_dir=$root/$name-tpp$budget-s$5 \
        branch_from=$root/$name-tpp10.0-s$5 || exit 1; done; }) > "$log" 2>&1 ||
    { echo "error: ladder run $* ${LADDER_ARGS:-} failed; its log: $log" >&2; return 1; }
}
study800_run() {  # scale seed: the 5x-budget check, dense-study, AdamW, cosine, 800 steps
  local log=runs/ladder_logs/study800-$1-s$2.log
  $PY -m scalevec_train.train +experiment=study_base train.steps=800 scale=$1 seed=$2 \
    run_dir=runs/ladder/study800/dense-study-$1-adamw-cosine-steps800-s$2 > "$log" 2>&1 ||
    { echo "error: 5x-budget run $* failed; its log: $log" >&2; return 1; }
}
# run_dir: the embedded task scored on its final checkpoint, into run_dir/next_line.txt
task_run() {
  test -f "$1/next_line.txt" && return
  $PY -m scalevec_train.evaluate "$1" tasks=embedded > "$1/next_line.tmp" &&
    mv "$1/next_line.tmp" "$1/next_line.txt" ||
    { echo "error: scoring $1 failed" >&2; return 1; }
}
# The AdamW dense-l3 study (docs/results/why-unified-loses-under-adamw.md): one trunk of the
# ladder's settings, diagnostics on (they change no number), in runs/adamw_l3/<rung>-<name>-s<seed>,
# the name giving every key the run varies.
diag_every() { case $1 in dense-l1) echo 30 ;; *) echo 180 ;; esac; }
arm_run() {  # rung name seed overrides...: into ARMS (runs/adamw_l3), logs in ARMS_logs; with
             # ARMS_ARCHIVE set, a run kept there is done, and a run that finishes or diverges is
             # kept there (scripts/lr_grid.py --archive: the records, no checkpoints)
  local rung=$1 name=$2 seed=$3 root=${ARMS:-runs/adamw_l3} rc=0
  shift 3
  local run=$rung-$name-s$seed
  local log=${root}_logs/$run.log
  if test -n "${ARMS_ARCHIVE:-}"; then
    test -f "$ARMS_ARCHIVE/$run/metrics.jsonl" -o -f "$ARMS_ARCHIVE/$run.failed" && return
  fi
  $PY -m scalevec_train.train +experiment=ladder model=$rung seed=$seed $(rung_args "$rung") \
    train.diagnostics_every=$(diag_every "$rung") "$@" run_dir=$root/$run > "$log" 2>&1 || rc=$?
  if test -n "${ARMS_ARCHIVE:-}"; then
    # a divergence (exit status 3) is kept as a result; any other failure stops the study
    $PY scripts/lr_grid.py --archive "$ARMS_ARCHIVE" done "$root" "$root/$run" $rc
  elif test $rc != 0; then
    echo "error: study run $rung $name s$seed failed; its log: $log" >&2
    return 1
  fi
}
on_two_workers() {  # each input line: a function above and its arguments; longest jobs first
  export -f rung_args ladder_run study800_run task_run diag_every arm_run
  export PY
  xargs -L 1 -P 2 bash -c '"$@"' _
}
LADDER_LRS="0.001 0.003 0.01 0.03"
ladder() {  # optimizers out [jobs]: the ladder of both strategies under each optimizer named, in
            # the folder LADDER (runs/ladder) with the overrides LADDER_ARGS, its tables to out;
            # `jobs seed` prints more jobs to run beside each seed's rungs
  local optims=$1 out=$2 L=${LADDER:-runs/ladder} picks scale optim lr seed rung metric d
  mkdir -p $out
  # 1. The LR grid: every arm (scale x optimizer) on dense-l2, seed 0, the same four peak LRs
  #    (LADDER_LRS).
  for scale in baseline unified; do for optim in $optims; do for lr in $LADDER_LRS; do
    echo ladder_run dense-l2 $scale $optim $lr 0 trunk
  done; done; done | on_two_workers
  picks=$($PY scripts/ladder_report.py lr $out/lr_grid.md \
    $(for optim in $optims; do ls -d $L/dense-l2-*-$optim-lr*-tpp10.0-s0; done))
  # 2. Every arm at its own best LR: rungs x 3 seeds (the grid's dense-l2 seed-0 trunk is reused).
  for rung in dense-l3 ${3:-} dense-l2 dense-l1; do
    for seed in 0 1 2; do
      case $rung in
        dense-l*) echo "$picks" | while read -r scale optim lr; do
          echo ladder_run $rung $scale $optim $lr $seed; done ;;
        *) $rung $seed ;;
      esac
    done
  done | on_two_workers
  # 3. The tables and fits. Each optimizer's arms at their picked LRs (optim.lr tells the arms apart
  #    only through the strategy, so it is left out of the grouping).
  arm_runs() {  # optim: that optimizer's ladder runs, trunks and branches, at the picked LRs
    echo "$picks" | while read -r scale optim lr; do
      if [ "$optim" = "$1" ]; then ls -d $L/dense-l[123]-$scale-$optim-lr$lr-tpp*-s[012]; fi
    done
  }
  # the embedded downstream task (chance 0.25) on every trunk's final checkpoint
  for d in $(for optim in $optims; do arm_runs $optim; done); do
    case $d in *-tpp10.0-s*) echo task_run $d ;; esac
  done | on_two_workers
  $PY scripts/ladder_report.py table $out/terminal.md \
    $(for optim in $optims; do arm_runs $optim; done)
  for optim in $optims; do
    for metric in val_loss val_bpb; do
      $PY scripts/compare_runs.py $(arm_runs $optim) --efficiency --reference scale=baseline \
        --ignore optim.lr --metric $metric --out $out/efficiency_${optim}_$metric
    done
  done
}
# seed: the 5x-budget check
study800_jobs() { echo study800_run baseline $1; echo study800_run unified $1; }
grid_worker() {  # root parts...: trains scripts/lr_grid.py's queue of runs until none is left (the
  # finished runs kept in $GRID_ARCHIVE too where it is set)
  # this worker's pid: $BASHPID inside $(...) is the subshell's
  local root=$1 me=$BASHPID rc job rung dir args
  local grid="$PY scripts/lr_grid.py ${GRID_ARCHIVE:+--archive $GRID_ARCHIVE}"
  shift
  while :; do
    rc=0
    job=$($grid next "$root" $me "$@") || rc=$?
    case $rc in 0) ;; 3) sleep 20; continue ;; 4) return 0 ;; *) return 1 ;; esac
    read -r rung dir args <<<"$job"
    rc=0
    $PY -m scalevec_train.train +experiment=ladder model=$rung $(rung_args $rung) $args \
      > "${root}_logs/$(basename "$dir").log" 2>&1 || rc=$?
    $grid done "$root" "$dir" $rc || return 1
  done
}
grid_pool() {  # root parts...: two workers on one queue
  local a b
  grid_worker "$@" & a=$!
  grid_worker "$@" & b=$!
  wait $a && wait $b
}

case ${1:-main} in
  main)
    # Revision 1's placement reading (targets q, k, o, down) runs as its own arm beside every dp,
    # dnp and unified arm (run directories *-rev1-*).
    sweeps "+experiment=study_optim optim=muon schedule=cosine" \
      "+experiment=study_optim optim=muon schedule=wsd" \
      "+experiment=study_moe" "+experiment=study_rev1" \
      "+experiment=study_dense seed=0" "+experiment=study_dense seed=1" \
      "+experiment=study_dense seed=2" \
      "+experiment=study_wd" \
      "+experiment=study_rev1 scale=unified optim=muon schedule=cosine" \
      "+experiment=study_rev1 scale=unified optim=muon schedule=wsd" \
      "+experiment=study_optim optim=adamw schedule=wsd" \
      "+experiment=study_rev1 scale=unified model=moe-study" \
      "+experiment=study_rev1 scale=unified schedule=wsd"
    compare removal scale=baseline $R/dense-study-{none,baseline}-adamw-cosine-s*
    compare single scale=baseline \
      $R/dense-study-{baseline,iwd,hg,dp,dnp,or,er,unified}-adamw-cosine-s* \
      $R/dense-study-{dp,dnp,unified}-rev1-adamw-cosine-s*
    compare wd_policy scale=baseline $R/dense-study-gemma-{baseline,wd_all,iwd}-adamw-cosine-s*
    compare muon_cosine scale=baseline $R/dense-study-{baseline,unified,unified-rev1}-muon-cosine-s*
    compare adamw_wsd scale=baseline $R/dense-study-{baseline,unified,unified-rev1}-adamw-wsd-s*
    compare muon_wsd scale=baseline $R/dense-study-{baseline,unified,unified-rev1}-muon-wsd-s*
    compare moe scale=baseline $R/moe-study-{baseline,unified,unified-rev1}-adamw-cosine-s*
    ;;
  lr_sweep)
    for scale in baseline dnp unified; do
      for seed in 0 1 2; do
        test -f $R/dense-study-$scale-adamw-cosine-s$seed/metrics.jsonl || {
          echo "error: $R/dense-study-$scale-adamw-cosine-s$seed is missing. \
Fix: run the main study first" \
            "(bash scripts/run_study.sh)." >&2
          exit 2
        }
      done
    done
    sweeps "+experiment=study_lr optim.lr=1.0e-3" "+experiment=study_lr optim.lr=1.0e-2"
    compare lr_sweep "scale=baseline optim.lr=0.003" \
      $R/dense-study-{baseline,dnp,unified}-adamw-cosine-s* \
      $R/dense-study-{baseline,dnp,unified}-adamw-cosine-lr*-s*
    ;;
  ladder)
    ladder "adamw muon" docs/results/ladder study800_jobs
    compare ladder/study800 scale=baseline $L/study800/dense-study-*-s*
    ;;
  adamw_l3)
    A=runs/adamw_l3
    out=docs/results/adamw_l3
    mkdir -p runs/adamw_l3_logs $out
    # name | overrides: every arm at dense-l3 with AdamW unless it says otherwise; the ladder's
    # picks are baseline 3e-3 and unified 1e-2 (AdamW), 1e-2 for both under Muon
    arms() {
      cat <<'ARMS'
baseline-muon-lr0.01|scale=baseline optim=muon optim.lr=0.01
unified-muon-lr0.01|scale=unified optim=muon optim.lr=0.01
baseline-muon-lr0.01-adamw_lr0.003|scale=baseline optim=muon optim.lr=0.01 optim.adamw_lr=0.003
unified-muon-lr0.01-adamw_lr0.003|scale=unified optim=muon optim.lr=0.01 optim.adamw_lr=0.003
baseline-adamw-lr0.003|scale=baseline optim=adamw optim.lr=0.003
unified-adamw-lr0.01|scale=unified optim=adamw optim.lr=0.01
baseline-adamw-lr0.003-scale_lr0.01|scale=baseline optim=adamw optim.lr=0.003 optim.scale_lr=0.01
baseline-adamw-lr0.003-scale_lr0.03|scale=baseline optim=adamw optim.lr=0.003 optim.scale_lr=0.03
unified-adamw-lr0.003|scale=unified optim=adamw optim.lr=0.003
unified-adamw-lr0.003-scale_lr0.01|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01
unified-adamw-lr0.003-scale_lr0.03|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.03
unified-adamw-lr0.01-heterogeneity.shared|scale=unified optim=adamw optim.lr=0.01 scale.heterogeneity=shared
unified-adamw-lr0.01-placement.pre|scale=unified optim=adamw optim.lr=0.01 scale.placement=pre
unified-adamw-lr0.01-reparam.plain|scale=unified optim=adamw optim.lr=0.01 scale.reparam=plain
unified-adamw-lr0.01-weight_decay.none|scale=unified optim=adamw optim.lr=0.01 scale.weight_decay=none
unified-adamw-lr0.01-targets.gate.up|scale=unified optim=adamw optim.lr=0.01 scale.targets=[gate,up]
unified-adamw-lr0.01-targets.q.k.gate.up|scale=unified optim=adamw optim.lr=0.01 scale.targets=[q,k,gate,up]
unified-adamw-lr0.01-scale_wd0.01|scale=unified optim=adamw optim.lr=0.01 optim.scale_weight_decay=0.01
unified-adamw-lr0.01-decay_final_norm.false|scale=unified optim=adamw optim.lr=0.01 scale.decay_final_norm=false
ARMS
    }
    # The AdamW arms seed by seed first (the question; the study takes days on 2 cores, so whatever
    # part has finished answers it for the seeds done); then the AdamW half of the ladder again with
    # both arms' sites at optim.scale_lr=0.01, the setting under which unified was lower on 3 of 3
    # seeds (the issue asks for the ladder again with such a setting;
    # runs/adamw_l3/ladder_scale_lr0.01/, tables to $out/ladder_scale_lr0.01/ beside
    # docs/results/ladder/'s); then the Muon mirror, then dense-l1 at the ladder's LRs and swapped
    arms_of() {  # optim seeds...
      local optim=$1 seed
      shift
      for seed in "$@"; do
        arms | grep -- "-$optim-" | while IFS='|' read -r name args; do
          echo arm_run dense-l3 $name $seed $args; done
      done
    }
    arms_of adamw 0 1 2 | on_two_workers
    (export LADDER=$A/ladder_scale_lr0.01 LADDER_ARGS=optim.scale_lr=0.01; \
      ladder adamw $out/ladder_scale_lr0.01)
    {
      arms_of muon 0 1 2
      for seed in 0 1 2; do for lr in 0.003 0.01; do for scale in baseline unified; do
        echo arm_run dense-l1 $scale-adamw-lr$lr $seed scale=$scale optim=adamw optim.lr=$lr
      done; done; done
    } | on_two_workers
    # table baseline unified others...: prefixes under runs/adamw_l3; and the gap over training
    report() {
      local table=$1 base=$2 uni=$3 prefix others=()
      shift 3
      for prefix in "$@"; do others+=("$A/$prefix"); done
      $PY scripts/arm_report.py $out/$table.md --baseline $A/$base \
        --unified $A/$uni "${others[@]}" --over-training $out/${table}_over_training.md
    }
    report l3_adamw dense-l3-baseline-adamw-lr0.003 dense-l3-unified-adamw-lr0.01 \
      $(arms | cut -d'|' -f1 | grep -- -adamw- | sed 's/^/dense-l3-/')
    for scale_lr in 0.01 0.03; do  # both arms with the same scale LR, matrices at the baseline's
      report l3_adamw_scale_lr$scale_lr dense-l3-baseline-adamw-lr0.003-scale_lr$scale_lr \
        dense-l3-unified-adamw-lr0.003-scale_lr$scale_lr
    done
    report l3_adamw_lr0.003 dense-l3-baseline-adamw-lr0.003 dense-l3-unified-adamw-lr0.003
    # unified without IWD at its pick: its final norm's scale over training beside the baseline's
    report l3_adamw_no_iwd dense-l3-baseline-adamw-lr0.003 \
      dense-l3-unified-adamw-lr0.01-weight_decay.none
    report l3_muon dense-l3-baseline-muon-lr0.01 dense-l3-unified-muon-lr0.01 \
      dense-l3-baseline-muon-lr0.01-adamw_lr0.003 dense-l3-unified-muon-lr0.01-adamw_lr0.003
    report l3_muon_adamw_lr0.003 dense-l3-baseline-muon-lr0.01-adamw_lr0.003 \
      dense-l3-unified-muon-lr0.01-adamw_lr0.003
    report l1_adamw dense-l1-baseline-adamw-lr0.003 dense-l1-unified-adamw-lr0.01 \
      dense-l1-baseline-adamw-lr0.01 dense-l1-unified-adamw-lr0.003
    for lr in 0.003 0.01; do  # both arms at one LR
      report l1_adamw_lr$lr dense-l1-baseline-adamw-lr$lr dense-l1-unified-adamw-lr$lr
    done
    ;;
  ladder_grid_l3)
    # Supplementary: the same LR grid for every arm again on dense-l3 (seed 0 trunks), to see
    # whether an arm's best LR moves between dense-l2, where the ladder's LRs were picked, and
    # dense-l3. Trunks the ladder already ran are reused; without it, they are run here.
    L=runs/ladder
    optims=${2:-adamw muon}
    for scale in baseline unified; do for optim in $optims; do for lr in $LADDER_LRS; do
      echo ladder_run dense-l3 $scale $optim $lr 0 trunk
    done; done; done | on_two_workers
    picks=$($PY scripts/ladder_report.py lr docs/results/ladder/lr_grid_l3.md \
      $(for optim in $optims; do ls -d $L/dense-l3-*-$optim-lr*-tpp10.0-s0; done))
    # each arm at its dense-l3 pick with seeds 0, 1, 2 (trunks; the ladder's runs are reused where
    # the pick is the ladder's), compared per seed
    echo "$picks" | while read -r scale optim lr; do
      for seed in 1 2; do echo ladder_run dense-l3 $scale $optim $lr $seed trunk; done
    done | on_two_workers
    $PY scripts/ladder_report.py table docs/results/ladder/terminal_l3_picks.md \
      $(echo "$picks" | while read -r scale optim lr; do
        ls -d $L/dense-l3-$scale-$optim-lr$lr-tpp10.0-s[012]; done)
    ;;
  lr_ladder)
    # The ladder at each arm's best LR (docs/results/each-arm-at-its-best-lr.md): one queue
    # (scripts/lr_grid.py) of its parts, rung by rung from the smallest: every arm's AdamW grid (sp;
    # the sites at optim.scale_lr=0.01; 2 seeds, a third where the two best are within the seeds'
    # spread; then the sites' LR either side) and its ladder at the per-rung picks (3 seeds, WSD
    # branches); the same grid under model.parameterization=mup (base dense-l1); the mup ladder at
    # the dense-l1 pick; dense-l4 at that pick and a step either side (one seed); then Muon's grids
    # (one seed; sp, mup), last as they are cut first when time is short
    L=runs/lr_ladder
    out=docs/results/lr_ladder
    parts="adamw mup_adamw mup_tuned mup_l4 muon mup_muon"
    grid_pool $L $parts
    $PY scripts/lr_grid.py report $L $out $parts
    for part in adamw mup_tuned; do
      for d in $(cat $out/${part}_final.txt); do
        case $d in *-tpp10-s*) echo task_run $d ;; esac
      done
    done | on_two_workers
    for part in adamw mup_tuned; do
      $PY scripts/ladder_report.py table $out/${part}_terminal.md $(cat $out/${part}_final.txt)
      for metric in val_loss val_bpb; do
        $PY scripts/compare_runs.py $(cat $out/${part}_final.txt) --efficiency \
          --reference scale=baseline --ignore optim.lr --ignore optim.scale_lr --metric $metric \
          --out $out/efficiency_${part}_$metric
      done
    done
    # what tuning once under mup costs each arm: its mup ladder against its own per-rung sp ladder
    for scale in baseline unified; do
      $PY scripts/compare_runs.py $(grep -- "-$scale-" $out/adamw_final.txt) \
        $(grep -- "-$scale-" $out/mup_tuned_final.txt) --efficiency \
        --series model.parameterization --reference model.parameterization=sp --ignore optim.lr \
        --ignore optim.scale_lr --ignore model.base_dim --ignore model.base_layers \
        --metric val_loss --out $out/efficiency_tuned_once_$scale
    done
    ;;
  scaling)
    # Does unified's gain grow with scale (docs/results/)? The AdamW ladder at each arm's own best
    # LR on dense-l4 and dense-l6 and on moe-l2..l4 (scripts/lr_grid.py's SCALING parts, in the
    # order that cuts dense-l6's third seed first, then moe-l4; dense-l6 without trunks), then each
    # rung's grid, picks and tables. Every finished run is kept in docs/results/scaling/runs/
    # (commit it): from a fresh clone the study goes on from there
    L=runs/scaling
    out=docs/results/scaling
    export GRID_ARCHIVE=$out/runs
    parts="dense_l4 dense_l1_l3 moe_l2 moe_l3 dense_l6 moe_l4 dense_l6_s2"
    grid_pool $L $parts
    $PY scripts/lr_grid.py --archive $GRID_ARCHIVE report $L $out $parts
    # per family: the multipliers per rung, budget and seed, their trend with its interval, the
    # laws' exponents, and the trend carried to dense-0.12b's compute (an extrapolation)
    for family in dense moe; do
      $PY scripts/compare_runs.py $(cat $out/${family}_*_final.txt) --efficiency \
        --reference scale=baseline --ignore optim.lr --ignore optim.scale_lr --metric val_loss \
        --extrapolate dense-0.12b --out $out/efficiency_$family
    done
    ;;
  fp8)
    # What scale vectors do to low precision: baseline and unified at dense-l3 in bf16 and under FP8
    # (model.fp8: torchao's float8, emulated on a CPU), tensorwise and rowwise, with every block map
    # in FP8 (model.fp8_filter=all: dense-l3's maps are all below torchao's size thresholds), each
    # arm at its pick of the AdamW ladder (docs/results/lr_ladder/adamw_grid.md: 3e-3 for both,
    # sites at 1e-2), 3 seeds; and unified's ablations under each precision: no output-side gate/up
    # sites (DNP on q, k, v only), plain sites (no magnitude-direction), one scale site per norm (no
    # HG). Diagnostics on: the maps' input outliers, FP8's underflow and its gradients' SNR against
    # bf16's. Runs to runs/fp8/, tables to docs/results/fp8/, each finished run's record to
    # docs/results/fp8/runs/ (commit it: from a fresh clone the study goes on from there)
    A=runs/fp8
    out=docs/results/fp8
    K=$out/runs
    mkdir -p ${A}_logs $out
    # name | overrides, every arm at dense-l3 with model.fp8_filter=all
    fp8_arms() {
      cat <<'FP8ARMS'
baseline-adamw-lr0.003-scale_lr0.01|scale=baseline optim=adamw optim.lr=0.003 optim.scale_lr=0.01
baseline-adamw-lr0.003-scale_lr0.01-model.fp8.tensorwise|scale=baseline optim=adamw optim.lr=0.003 optim.scale_lr=0.01 model.fp8=tensorwise
baseline-adamw-lr0.003-scale_lr0.01-model.fp8.rowwise|scale=baseline optim=adamw optim.lr=0.003 optim.scale_lr=0.01 model.fp8=rowwise
unified-adamw-lr0.003-scale_lr0.01|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01
unified-adamw-lr0.003-scale_lr0.01-model.fp8.tensorwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 model.fp8=tensorwise
unified-adamw-lr0.003-scale_lr0.01-model.fp8.rowwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 model.fp8=rowwise
unified-adamw-lr0.003-scale_lr0.01-targets.q.k.v|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.targets=[q,k,v]
unified-adamw-lr0.003-scale_lr0.01-targets.q.k.v-model.fp8.tensorwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.targets=[q,k,v] model.fp8=tensorwise
unified-adamw-lr0.003-scale_lr0.01-targets.q.k.v-model.fp8.rowwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.targets=[q,k,v] model.fp8=rowwise
unified-adamw-lr0.003-scale_lr0.01-reparam.plain|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.reparam=plain
unified-adamw-lr0.003-scale_lr0.01-reparam.plain-model.fp8.tensorwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.reparam=plain model.fp8=tensorwise
unified-adamw-lr0.003-scale_lr0.01-reparam.plain-model.fp8.rowwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.reparam=plain model.fp8=rowwise
unified-adamw-lr0.003-scale_lr0.01-heterogeneity.shared|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.heterogeneity=shared
unified-adamw-lr0.003-scale_lr0.01-heterogeneity.shared-model.fp8.tensorwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.heterogeneity=shared model.fp8=tensorwise
unified-adamw-lr0.003-scale_lr0.01-heterogeneity.shared-model.fp8.rowwise|scale=unified optim=adamw optim.lr=0.003 optim.scale_lr=0.01 scale.heterogeneity=shared model.fp8=rowwise
FP8ARMS
    }
    # seed by seed, the main arms of a seed before its ablations: whatever has finished answers for
    # its seeds
    export ARMS=$A ARMS_ARCHIVE=$K
    for seed in 0 1 2; do
      fp8_arms | while IFS='|' read -r name args; do
        echo arm_run dense-l3 $name $seed model.fp8_filter=all $args
      done
    done | on_two_workers
    # each strategy (and ablation) in bf16 against its two FP8 recipes; then baseline against
    # unified, one precision at a time, with the diagnostics beside the losses
    for arm in $(fp8_arms | cut -d'|' -f1 | grep -v -- -model.fp8.); do
      compare fp8/$arm model.fp8=none $K/dense-l3-$arm{,-model.fp8.tensorwise,-model.fp8.rowwise}-s*
    done
    for suffix in "" -model.fp8.tensorwise -model.fp8.rowwise; do
      $PY scripts/compare_runs.py \
        $K/dense-l3-{baseline,unified}-adamw-lr0.003-scale_lr0.01$suffix-s0 --diagnostics \
        --out $out/diagnostics${suffix:-"-bf16"}
    done
    # the per-seed table and each arm's penalty against the baseline's, by seed
    $PY scripts/fp8_table.py $K > $out/per_seed.md
    ;;
  *)
    echo "error: unknown part '$1'. \
Fix: use main (the default), lr_sweep, ladder, adamw_l3, ladder_grid_l3," \
      "lr_ladder, scaling or fp8." >&2
    exit 2
    ;;
esac

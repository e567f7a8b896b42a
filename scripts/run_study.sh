#!/usr/bin/env bash
# The CPU reproduction study (docs/results.md): every arm's sweep, then one comparison per claim.
#   bash scripts/run_study.sh            the main study (from the repository root, after `make setup`)
#   bash scripts/run_study.sh lr_sweep   the supplementary learning-rate sweep (reuses the main study's
#                                        lr 3e-3 runs: run the main study first)
# Two workers, one CPU thread each, take the sweeps from a queue, longest first (Muon's bf16
# Newton-Schulz makes its runs about twice as long on a CPU), so both cores stay busy to the end; the same
# seeds give the same numbers on the same machine whichever worker runs them. Finished runs are reused
# (resume=auto), so an interrupted study continues where it stopped. Runs go to runs/study/, each
# sweep's log to runs/study_logs/, comparisons (curves.png, summary.md, summary.csv) to docs/results/.
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
  done | xargs -L 1 -P 2 bash -c '"$0" -m scalevec_train.train -m "${@:2}" > "runs/study_logs/$1.log" 2>&1 ||
    { echo "error: sweep $1 (${*:2}) failed; its log: runs/study_logs/$1.log" >&2; exit 1; }' "$PY"
}

case ${1:-main} in
  main)
    # Revision 1's placement reading (targets q, k, o, down) runs as its own arm beside every dp, dnp
    # and unified arm (run directories *-rev1-*).
    sweeps "+experiment=study_optim optim=muon schedule=cosine" "+experiment=study_optim optim=muon schedule=wsd" \
      "+experiment=study_moe" "+experiment=study_rev1" \
      "+experiment=study_dense seed=0" "+experiment=study_dense seed=1" "+experiment=study_dense seed=2" \
      "+experiment=study_wd" \
      "+experiment=study_rev1 scale=unified optim=muon schedule=cosine" \
      "+experiment=study_rev1 scale=unified optim=muon schedule=wsd" \
      "+experiment=study_optim optim=adamw schedule=wsd" "+experiment=study_rev1 scale=unified model=moe-study" \
      "+experiment=study_rev1 scale=unified schedule=wsd"
    compare removal scale=baseline $R/dense-study-{none,baseline}-adamw-cosine-s*
    compare single scale=baseline $R/dense-study-{baseline,iwd,hg,dp,dnp,or,er,unified}-adamw-cosine-s* \
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
          echo "error: $R/dense-study-$scale-adamw-cosine-s$seed is missing. Fix: run the main study first" \
            "(bash scripts/run_study.sh)." >&2
          exit 2
        }
      done
    done
    sweeps "+experiment=study_lr optim.lr=1.0e-3" "+experiment=study_lr optim.lr=1.0e-2"
    compare lr_sweep "scale=baseline optim.lr=0.003" $R/dense-study-{baseline,dnp,unified}-adamw-cosine-s* \
      $R/dense-study-{baseline,dnp,unified}-adamw-cosine-lr*-s*
    ;;
  *)
    echo "error: unknown part '$1'. Fix: use main (the default) or lr_sweep." >&2
    exit 2
    ;;
esac

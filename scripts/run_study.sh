#!/usr/bin/env bash
# The CPU reproduction study (docs/results.md): every arm's sweep, then one comparison per claim.
#   bash scripts/run_study.sh            (from the repository root, after `make setup`)
# Two sweep streams run side by side, one CPU thread each (the same seeds give the same numbers on the
# same machine). Finished runs are reused (resume=auto), so an interrupted study continues where it
# stopped. Runs go to runs/study/, comparisons (curves.png, summary.md, summary.csv) to docs/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p runs
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
train() { $PY -m scalevec_train.train -m "$@"; }

(
  train +experiment=study_dense
  train +experiment=study_wd
) > runs/study_stream_a.log 2>&1 &
stream_a=$!
(
  train +experiment=study_optim optim=muon
  train +experiment=study_optim optim=adamw schedule=wsd
  train +experiment=study_moe
) > runs/study_stream_b.log 2>&1 &
stream_b=$!
wait $stream_a
wait $stream_b

R=runs/study
compare() {  # name reference run-dir globs...
  local name=$1 ref=$2
  shift 2
  $PY scripts/compare_runs.py "$@" --reference "$ref" --out docs/results/$name
}
compare removal scale=baseline $R/dense-study-{none,baseline}-adamw-cosine-s*
compare single scale=baseline $R/dense-study-{baseline,iwd,hg,dp,dnp,or,er,unified}-adamw-cosine-s*
compare wd_policy scale=baseline $R/dense-study-gemma-{baseline,wd_all,iwd}-adamw-cosine-s*
compare muon_cosine scale=baseline $R/dense-study-{baseline,unified}-muon-cosine-s*
compare adamw_wsd scale=baseline $R/dense-study-{baseline,unified}-adamw-wsd-s*
compare muon_wsd scale=baseline $R/dense-study-{baseline,unified}-muon-wsd-s*
compare moe scale=baseline $R/moe-study-{baseline,unified}-adamw-cosine-s*

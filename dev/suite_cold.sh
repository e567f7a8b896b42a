#!/usr/bin/env bash
# The CI run as a new CI machine makes it, N times in a row: a fresh clone of COMMIT,
# `CI=true bash .ci/run`, with torch's inductor and Triton caches and scalevec's kernel cache empty
# (pip's package cache kept).
# One line per run (exit status, seconds, load average, pytest's summary) to stdout and to
# OUT/summary.txt, each run's log beside it (the 80 slowest tests at its end). dev/README.md, "The
# test suite".
#
#   bash dev/suite_cold.sh [COMMIT] [N] [OUT]      (defaults: HEAD, 1, /tmp/suite_cold)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
commit=$(git -C "$repo" rev-parse --short "${1:-HEAD}") || exit 2
n=${2:-1}
out=${3:-/tmp/suite_cold}
mkdir -p "$out"
for i in $(seq 1 "$n"); do
  work=$(mktemp -d)
  git clone -q "$repo" "$work/clone" && git -C "$work/clone" checkout -q "$commit" || exit 2
  log=$out/$commit-$i.log
  start=$(date +%s)
  (cd "$work/clone" && CI=true XDG_CACHE_HOME="$work/cache" \
    PIP_CACHE_DIR="${PIP_CACHE_DIR:-$HOME/.cache/pip}" TORCHINDUCTOR_CACHE_DIR="$work/inductor" \
    TRITON_CACHE_DIR="$work/triton" PYTEST_ADDOPTS="${PYTEST_ADDOPTS:---durations=80}" \
    bash .ci/run > "$log" 2>&1)
  rc=$?
  line="$commit run $i/$n: rc=$rc $(( $(date +%s) - start )) s, load \
$(cut -d' ' -f1-3 /proc/loadavg), $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
  echo "$line" | tee -a "$out/summary.txt"
  rm -rf "$work"
done

#!/usr/bin/env bash
# Every GPU check and measurement of the project, in phases, for a lent GPU machine (Python 3.12, torch,
# triton, transformers, sentencepiece, matplotlib, tensorboard, pytest-xdist installed; no registry).
# On the machine with the registry, first fill .whl/ with what the GPU host lacks (hydra-core, omegaconf,
# antlr4, and torchtitan with the pure-Python packages it imports):
#   ../shared/tools/gpu-wheels.sh $(cat scripts/gpu_wheels.txt)
# then on the GPU machine, from the repository root (with .whl carried):
#   bash scripts/gpu_session.sh [PHASE ...]        (no PHASE: all of them, in this order)
#     suite          the whole CPU suite on this host (GPUs hidden, as on any machine)     cpu_suite.log
#     gpu-tests      tests/gpu: kernels in bf16, the trainer in bf16 eager and compiled,    gpu_tests.log
#                    MoE grouped_mm, Muon on CUDA, resume on CUDA
#     kernels        scripts/bench_kernels.py: fused ops against the copy bandwidth        bench_kernels.md
#     train-1b       scripts/bench_train.py: dense-0.12b and dense-1b, baseline and        bench_train_1b.md
#                    unified; dense-1b's optimizer step with Muon
#     torchtitan     scripts/bench_torchtitan.py: the dense-1b shape in torchtitan, then   bench_torchtitan.md
#                    in scalevec (their logs torchtitan.log, scalevec.log)
#     train-2b       dense-2b (activation checkpointing) and moe-2b                         bench_train_2b.md
# Files go to $OUT (default ./gpu_out), with device.txt (GPU, driver, torch). Each log ends with its exit
# status (rc=N). A phase stops at its time limit (the number after its name below); the device tool
# runs at most 600 s per command, so split the phases over calls whose limits add up to less, e.g.
# `suite gpu-tests`, then `kernels train-1b`, then `torchtitan train-2b`. Paste the tables into
# docs/benchmarks.md with the device and the date they print.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# the packages from the checkout, without installing: kernels/ holds scalevec_kernels
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
phase() {  # log limit_s command...: run with a time limit, keep the whole log and its exit status
  local log=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$log" 2>&1
  echo "rc=$?" >> "$out/$log"
  tail -n 20 "$out/$log"
}
bench_1b() {
  python3 scripts/bench_train.py --presets dense-0.12b --scales baseline,unified &&
  python3 scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 --micro-batch 4 &&
  python3 scripts/bench_train.py --presets dense-1b --scales baseline --seq-len 4096 --micro-batch 4 -- optim=muon
}
bench_2b() {
  python3 scripts/bench_train.py --presets dense-2b --scales baseline,unified --micro-batch 2 \
    -- distributed.activation_checkpointing=full &&
  python3 scripts/bench_train.py --presets moe-2b --scales baseline,unified
}
ALL="suite gpu-tests kernels train-1b torchtitan train-2b"
phases=("$@")
[ $# -gt 0 ] || read -ra phases <<< "$ALL"
for name in "${phases[@]}"; do  # every name checked before any device time is spent
  [[ " $ALL " == *" $name "* ]] || { echo "error: unknown phase '$name'. Fix: use some of: $ALL." >&2; exit 2; }
done
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$out/device.txt"
for name in "${phases[@]}"; do
  case $name in
    # the CPU suite on 8 of the host's cores, each test file on one worker (as `make test` does)
    suite) phase cpu_suite.log 300 python3 -m pytest -q -x -p no:cacheprovider -n 8 --dist loadfile ;;
    gpu-tests) phase gpu_tests.log 240 env SCALEVEC_GPU_TESTS=1 python3 -m pytest -q -p no:cacheprovider tests/gpu ;;
    kernels) phase bench_kernels.md 180 python3 scripts/bench_kernels.py ;;
    train-1b) phase bench_train_1b.md 360 bash -c "$(declare -f bench_1b); bench_1b" ;;
    torchtitan) phase bench_torchtitan.md 360 python3 scripts/bench_torchtitan.py --preset dense-1b \
      --seq-len 4096 --micro-batch 4 --out "$out" ;;
    train-2b) phase bench_train_2b.md 240 bash -c "$(declare -f bench_2b); bench_2b" ;;
  esac
done

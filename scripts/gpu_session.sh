#!/usr/bin/env bash
# Every GPU check and measurement of the project in one call, for a lent GPU machine (Python 3.12,
# torch, triton, transformers, sentencepiece, matplotlib installed; no registry). On the machine with
# the registry, first run
#   ../shared/tools/gpu-wheels.sh pytest-xdist==3.8.0 execnet==2.1.1
# (fills .whl/ with hydra-core, omegaconf, antlr4, and pytest-xdist for the CPU suite's workers)
# then on the GPU machine, from the repository root (with .whl carried):
#   bash scripts/gpu_session.sh [OUT_DIR]
# It installs the wheels into /tmp/site, then writes to OUT_DIR (default $OUT or ./gpu_out):
#   device.txt              the GPU, driver and torch version
#   cpu_suite.log           the whole CPU suite on this host (GPUs hidden, as on any machine)
#   gpu_tests.log           tests/gpu: kernels in bf16, the trainer in bf16 eager and compiled, MoE
#                           grouped_mm, Muon on CUDA, resume on CUDA (SCALEVEC_GPU_TESTS=1)
#   bench_kernels.md        scripts/bench_kernels.py: fused ops against the copy bandwidth
#   bench_train.md          scripts/bench_train.py: tokens/s, MFU, memory of the presets, Muon vs AdamW
# Each log ends with its exit status (rc=N). Paste the tables into docs/benchmarks.md with the device
# and the date they print. Budget: about 20 minutes; each phase has its own time limit.
set -uo pipefail
out=${1:-${OUT:-gpu_out}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
# the packages from the checkout, without installing: kernels/ holds scalevec_kernels
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
phase() {  # name limit_s command...: run with a time limit, keep the whole log and its exit status
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name" 2>&1
  echo "rc=$?" >> "$out/$name"
  tail -n 15 "$out/$name"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$out/device.txt"
# the CPU suite on 8 of the host's cores, each test file on one worker (as `make test` does)
phase cpu_suite.log 420 python3 -m pytest -q -x -p no:cacheprovider -n 8 --dist loadfile
phase gpu_tests.log 300 env SCALEVEC_GPU_TESTS=1 python3 -m pytest -q -p no:cacheprovider tests/gpu
phase bench_kernels.md 240 python3 scripts/bench_kernels.py
{
  python3 scripts/bench_train.py --presets dense-0.12b --scales baseline,unified
  python3 scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 --micro-batch 4
  python3 scripts/bench_train.py --presets dense-2b --scales baseline,unified --micro-batch 2 \
    -- distributed.activation_checkpointing=full
  python3 scripts/bench_train.py --presets moe-2b --scales baseline,unified
  python3 scripts/bench_train.py --presets dense-1b --scales baseline --seq-len 4096 --micro-batch 4 -- optim=muon
} > "$out/bench_train.md" 2>&1
echo "rc=$?" >> "$out/bench_train.md"
tail -n 30 "$out/bench_train.md"

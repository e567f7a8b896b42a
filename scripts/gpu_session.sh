#!/usr/bin/env bash
# Every GPU measurement of the project in one run, for a lent GPU machine (Python 3.12, torch, triton,
# transformers and sentencepiece installed; no registry). On the machine with the registry, first run
#   ../shared/tools/gpu-wheels.sh            (fills .whl/ with hydra-core, omegaconf, antlr4)
# then on the GPU machine, from the repository root:
#   bash scripts/gpu_session.sh [OUT_DIR]
# It installs the wheels into /tmp/site, then writes to OUT_DIR (default $OUT or ./gpu_out):
#   kernels_gpu_tests.log   pytest tests/gpu (bf16 kernel accuracy, determinism, compile)
#   bench_kernels.md        scripts/bench_kernels.py table (issue 7)
#   bench_train.md          scripts/bench_train.py table for the dense and MoE presets (issues 5, 12)
# Paste the tables into docs/benchmarks.md with the device and the date they print.
set -uo pipefail
out=${1:-${OUT:-gpu_out}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
# the packages from the checkout, without installing: kernels/ holds scalevec_kernels
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
# the whole log is kept (tracebacks included) with the exit status; the console gets its tail
SCALEVEC_GPU_TESTS=1 python3 -m pytest -q tests/gpu > "$out/kernels_gpu_tests.log" 2>&1
echo "rc=$?" >> "$out/kernels_gpu_tests.log"
tail -n 30 "$out/kernels_gpu_tests.log"
python3 scripts/bench_kernels.py 2>&1 | tee "$out/bench_kernels.md"
python3 scripts/bench_train.py --presets dense-0.12b --scales baseline,unified 2>&1 | tee "$out/bench_train.md"
python3 scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 --micro-batch 4 \
  2>&1 | tee -a "$out/bench_train.md"
python3 scripts/bench_train.py --presets dense-2b --scales baseline,unified --micro-batch 2 \
  -- distributed.activation_checkpointing=full 2>&1 | tee -a "$out/bench_train.md"
python3 scripts/bench_train.py --presets moe-2b --scales baseline,unified 2>&1 | tee -a "$out/bench_train.md"

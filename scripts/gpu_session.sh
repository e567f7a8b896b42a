#!/usr/bin/env bash
# Every GPU check and measurement of the project, in phases, for one visit to a lent GPU machine (the device
# tool: at most 600 s per command and 30 min of device time per session; Python 3.12, torch 2.11, triton,
# transformers, sentencepiece, matplotlib and pytest-xdist installed; no registry, hydra-core or datasets).
#
#   bash ../shared/tools/gpu-wheels.sh $(cat scripts/gpu_wheels.txt)   # here, with the registry: fills .whl/
#   bash scripts/gpu_session.sh --dry-run [PHASE ...]     # here, no GPU needed: checks, then prints the plan
#   bash scripts/gpu_session.sh PHASE ...                 # there: one device command, with .whl carried
#
# The plan is one device command per entry of CALLS, most valuable first: the first alone brings the fused
# kernels' share of copy bandwidth and dense-1b's MFU under baseline and unified. --dry-run checks the phase
# names, the wheels in .whl/, every command's arguments (each bench script's parser, the configs it will
# compose, pytest's collection with the packages the GPU host lacks hidden) and the budgets: each call's worst
# case (every phase at its limit) within the 600 s of a device command, the plan's within the session's
# 30 min; it exits 2 on a plan error, 1 when only wheels are missing. PHASE... given: those phases as one
# call, checked likewise; none given: the whole plan (a real run then runs every phase, in plan order, for a
# machine without a per-command limit). A phase's limit can be overridden with GPU_SESSION_LIMIT_<PHASE>
# (upper case, '-' as '_'), e.g. GPU_SESSION_LIMIT_TRAIN_1B=300. Files go to $OUT (default ./gpu_out):
# device.txt, one log per phase ending with its exit status and wall time, and times.txt (phase, exit
# status, wall and limit seconds) for budgeting the next visit: at most 6 files a call of the plan (the
# device tool brings back 8). Paste the tables into docs/benchmarks.md
# with the device and date they print; docs/benchmarks.md says how each limit was estimated.
set -uo pipefail
cd "$(dirname "$0")/.."

CALLS=("kernels train-1b kernels-compile" "torchtitan gpu-tests" "train-2b muon suite")
# phase limit (s) and log; the estimates behind the limits are in docs/benchmarks.md
declare -A LIMIT=([kernels]=120 [train-1b]=240 [kernels-compile]=150 [torchtitan]=270 [gpu-tests]=150
                  [train-2b]=240 [muon]=130 [suite]=150)
declare -A LOG=([kernels]=bench_kernels.md [train-1b]=bench_train_1b.md [kernels-compile]=bench_kernels_compile.md
                [torchtitan]=bench_torchtitan.md [gpu-tests]=gpu_tests.log [train-2b]=bench_train_2b.md
                [muon]=bench_muon.md [suite]=cpu_suite.log)
# The device tool's limits, and the costs around the phases: a fresh machine's start ("a minute or more"),
# the tree and $OUT copied each call, the setup of a call (pip-installing .whl: 4 s here; device.txt: one
# torch import), and the grace a phase gets to die after its limit (timeout -k).
DEVICE_CALL_S=600 DEVICE_SESSION_S=1800 START_S=120 TRANSFER_S=15 SETUP_S=30 KILL_S=10
# What ../shared/tools/gpu-wheels.sh always fetches, before the specs of scripts/gpu_wheels.txt
BASE_WHEELS="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3"
# Import names the suite uses that the GPU host lacks (its tests skip there); hidden in the dry run's collection
HOST_LACKS="datasets wandb hydra_plugins.hydra_submitit_launcher"

# Each phase's commands, through cmd: run, or under --dry-run written down for scripts/gpu_session_check.py.
cmd() {
  if [ -n "$dry" ]; then printf '%q ' "$@" >> "$checks" && echo >> "$checks"; else "$@"; fi
}
phase_kernels() { cmd "$py" scripts/bench_kernels.py --against eager; }
phase_train_1b() {
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 --micro-batch 4
}
phase_kernels_compile() {  # one M and fewer widths: torch.compile compiles once per (N, K) and (F, experts)
  cmd "$py" scripts/bench_kernels.py --against compile --m 16384 --n 1024 2048 4096 --k 1 3 --f 2304 8192
}
phase_torchtitan() {
  cmd "$py" scripts/bench_torchtitan.py --preset dense-1b --seq-len 4096 --micro-batch 4 --out "$out"
}
phase_gpu_tests() {  # six workers share the GPU: their Triton JIT and compilation run side by side
  cmd env SCALEVEC_GPU_TESTS=1 "$py" -m pytest -q -p no:cacheprovider -n 6 tests/gpu
}
phase_train_2b() {  # moe-2b runs whatever dense-2b's outcome; the phase fails if either does
  cmd "$py" scripts/bench_train.py --presets dense-2b --scales baseline --micro-batch 2 \
    -- distributed.activation_checkpointing=full
  local rc=$?
  cmd "$py" scripts/bench_train.py --presets moe-2b --scales baseline && return "$rc"
}
phase_muon() {
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales baseline --seq-len 4096 --micro-batch 4 -- optim=muon
}
phase_suite() {  # the CPU suite (GPUs hidden, as on any machine), each test file on one of 12 workers
  cmd "$py" -m pytest -q -p no:cacheprovider -n 12 --dist loadfile
}

error() { echo "error: $1" >&2; exit 2; }
limit() { local var=GPU_SESSION_LIMIT_${1^^}; var=${var//-/_}; echo "${!var:-${LIMIT[$1]}}"; }
worst() { local t=$SETUP_S name; for name in "$@"; do t=$((t + $(limit "$name") + KILL_S)); done; echo "$t"; }
show_call() {  # number, phases
  local n=$1 name
  shift
  printf 'call %s: bash scripts/gpu_session.sh %s\n' "$n" "$*"
  printf '  %-16s %4d s\n' setup "$SETUP_S"
  for name in "$@"; do printf '  %-16s %4d s  (+%d s to stop it)  %s\n' "$name" "$(limit "$name")" "$KILL_S" \
    "${LOG[$name]}"; done
  printf '  %-16s %4d s of %d\n' "worst case" "$(worst "$@")" "$DEVICE_CALL_S"
}

dry=
[ "${1:-}" = --dry-run ] && { dry=1; shift; }
ALL=${CALLS[*]}
for name in "$@"; do  # every name checked before any device time is spent
  [ -n "${LIMIT[$name]+x}" ] || error "unknown phase '$name'. Fix: use some of: $ALL."
done
declare -A seen=()
for name in $ALL; do seen[$name]=$((${seen[$name]:-0} + 1)); done
for name in "${!LIMIT[@]}" "${!seen[@]}"; do
  [ "${seen[$name]:-0}" = 1 ] && [ -n "${LIMIT[$name]+x}" ] || error "phase '$name' must have a limit and be \
in exactly one of CALLS (it is in ${seen[$name]:-0})."
  value=$(limit "$name")
  [[ $value =~ ^[1-9][0-9]*$ ]] || error "the limit of $name is '$value'. Fix: a whole number of seconds."
done
if [ $# -gt 0 ]; then calls=("$*"); else calls=("${CALLS[@]}"); fi
# Budgets: a call over a device command's limit would be killed part-way; the plan must fit one session.
if [ $# -gt 0 ] || [ -n "$dry" ]; then
  total=$START_S
  for i in "${!calls[@]}"; do
    read -ra names <<< "${calls[$i]}"
    t=$(worst "${names[@]}")
    total=$((total + t + TRANSFER_S))
    [ "$t" -le "$DEVICE_CALL_S" ] || error "call $((i + 1)) (${calls[$i]}) takes up to $t s, over the \
device tool's $DEVICE_CALL_S s per command. Fix: split it as CALLS does, or lower a GPU_SESSION_LIMIT_*."
  done
  [ $# -gt 0 ] || [ "$total" -le "$DEVICE_SESSION_S" ] || error "the plan takes up to $total s of device \
time, over the session's $DEVICE_SESSION_S s. Fix: lower a phase's limit or move a phase to a later visit."
fi

if [ -n "$dry" ]; then
  py=${PYTHON:-python3}
  [ -n "${PYTHON:-}" ] || [ ! -x .venv/bin/python ] || py=.venv/bin/python
  export PYTHONPATH=$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
  echo "plan: one device command per call (run with carry [\".whl\"] and timeout_s $DEVICE_CALL_S), in order"
  for i in "${!calls[@]}"; do read -ra names <<< "${calls[$i]}"; show_call $((i + 1)) "${names[@]}"; done
  [ $# -gt 0 ] || echo "session worst case: $total s of $DEVICE_SESSION_S (a machine's start $START_S s, \
$TRANSFER_S s of copying per call, and the calls)"
  status=0
  missing=()
  specs=($BASE_WHEELS $(cat scripts/gpu_wheels.txt))
  shopt -s nocaseglob
  for spec in "${specs[@]}"; do  # a wheel's file name starts with the project name, '-' and '.' as '_'
    name=${spec%%==*}
    compgen -G ".whl/${name//[-.]/_}-${spec#*==}-*.whl" > /dev/null || missing+=("$spec")
  done
  dupes=$(ls .whl/*.whl 2>/dev/null | sed 's|.*/||; s|-.*||' | tr 'A-Z' 'a-z' | sort | uniq -d | tr '\n' ' ')
  [ -z "$dupes" ] || { echo "wheels: .whl/ holds two versions of: $dupes(pip would refuse them all)."; status=2; }
  if [ ${#missing[@]} -eq 0 ]; then
    echo "wheels: .whl/ holds the ${#specs[@]} that gpu-wheels.sh and scripts/gpu_wheels.txt name"
  else
    echo "wheels: .whl/ lacks ${missing[*]}. Fix, from the repository root, with the package registry:"
    echo "  bash ../shared/tools/gpu-wheels.sh \$(cat scripts/gpu_wheels.txt)"
    [ "$status" -ne 0 ] || status=1
  fi
  checks=$(mktemp)
  out=${OUT:-gpu_out}
  for call in "${calls[@]}"; do for name in $call; do "phase_${name//-/_}"; done; done
  echo "commands:"
  "$py" scripts/gpu_session_check.py --host-lacks "$HOST_LACKS" < "$checks" || status=2
  rm -f "$checks"
  exit "$status"
fi

# The run, on the GPU machine.
py=${PYTHON:-python3}
out=${OUT:-gpu_out}
mkdir -p "$out"
: > "$out/times.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# the packages from the checkout, without installing: kernels/ holds scalevec_kernels
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 py out dry
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
  | tee "$out/device.txt"
for call in "${calls[@]}"; do
  for name in $call; do
    fn=phase_${name//-/_}
    export -f cmd "$fn"
    start=$SECONDS
    timeout -k "$KILL_S" "$(limit "$name")" bash -c "$fn" > "$out/${LOG[$name]}" 2>&1
    rc=$?
    echo "rc=$rc wall=$((SECONDS - start))s limit=$(limit "$name")s" >> "$out/${LOG[$name]}"
    printf '%-16s rc=%-3s wall=%4ss limit=%ss\n' "$name" "$rc" "$((SECONDS - start))" "$(limit "$name")" \
      >> "$out/times.txt"
    echo "== $name (${LOG[$name]})"
    tail -n 20 "$out/${LOG[$name]}"
  done
done
echo "== times"
cat "$out/times.txt"

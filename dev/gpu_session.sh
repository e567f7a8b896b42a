#!/usr/bin/env bash
# The project's GPU checks and measurements as one command under one deadline, most valuable phase
# first: the whole plan runs within DEADLINE_S seconds of its start (GPU_SESSION_DEADLINE, default
# 515), inside the command's timeout of COMMAND_S (540) seconds. The GPU host it is written for has
# Python 3.12, torch 2.11, Triton 3.6, transformers, sentencepiece and pytest-xdist, and no package
# registry, hydra-core or datasets: the missing pure-Python packages are installed from wheels in
# .whl/.
#
#   bash ../shared/tools/gpu-wheels.sh $(cat dev/gpu_wheels.txt)   # with a registry at hand: fills
#                                                                    .whl/
#   bash dev/gpu_session.sh --dry-run [PHASE ...]     # no GPU needed: checks, then prints the plan
#   bash dev/gpu_session.sh [PHASE ...]               # on the GPU host, .whl/ in the checkout,
#                                                       timeout 540 s
#
# No PHASE: the default plan (PLAN below). Each phase starts only if at least its MIN seconds are
# left before the deadline (GPU_SESSION_DEADLINE seconds after the start, default DEADLINE_S), and
# runs for at most its LIMIT or what is left, whichever is less; dev/gpu_phase.py ends every process
# it started, torchrun's workers included, before the next phase starts. Each phase writes its log
# into $OUT as it goes (the benchmarks print each row when it is measured), and session.txt gets the
# device, the versions and one line per phase (status, wall seconds, limit) as each phase ends: a
# command cut short still leaves what finished. The dry run checks the phase names, the wheels,
# every command's arguments (dev/gpu_session_check.py), that the plan's estimates fit its deadline,
# that the deadline and the setup fit the command's timeout, and that $OUT gets no more files than
# FILES_BACK; it exits 2 on a plan error, 1 when only wheels are missing. GPU_SESSION_LIMIT_<PHASE>
# (upper case, '-' as '_') overrides a phase's limit. dev/README.md says how each estimate was made;
# session.txt's wall seconds beside each estimate say how far off it was.
set -uo pipefail
cd "$(dirname "$0")/.."

PLAN=(kernels train-1b train-1b-kernels moe-2b gpu-tests torchtitan)
# Per phase: the estimate (s), the limit (s), the least time worth starting it with (s), its log in
# $OUT.
# The estimates are the walls measured on an H200 on 2026-11-26
# (docs/benchmarks/2026-11-26-h200.md), rounded up by a quarter or more, and scaled by the work a
# phase added since; the limits leave room for a slower compile.
# fp8's training runs are not measured yet (on 2026-12-04 they failed at their first compiled step,
# and the phase took 254 s with its GEMM table): its estimate is train-1b's for each of its three
# precisions (no profile) and the kernels phase's for its GEMM table; it runs in a command of its
# own (bash dev/gpu_session.sh fp8).
declare -A EST=([kernels]=100 [train-1b]=90 [train-1b-kernels]=60 [moe-2b]=90 [gpu-tests]=70
                [torchtitan]=80 [train-1b-eager]=35 [muon]=35 [train-2b]=100 [suite]=90 [fp8]=370)
declare -A LIMIT=([kernels]=160 [train-1b]=180 [train-1b-kernels]=120 [moe-2b]=160 [gpu-tests]=150
                  [torchtitan]=170 [train-1b-eager]=70 [muon]=80 [train-2b]=200 [suite]=150
                  [fp8]=480)
declare -A MIN=([kernels]=40 [train-1b]=60 [train-1b-kernels]=40 [moe-2b]=50 [gpu-tests]=45
                [torchtitan]=60 [train-1b-eager]=25 [muon]=30 [train-2b]=60 [suite]=60 [fp8]=120)
declare -A LOG=([kernels]=kernels.md [train-1b]=train_1b.md [train-1b-kernels]=train_1b_kernels.md
                [moe-2b]=moe_2b.md [gpu-tests]=gpu_tests.log [torchtitan]=torchtitan.md
                [train-1b-eager]=train_1b_eager.md [train-2b]=train_2b.md [muon]=muon.md
                [suite]=cpu_suite.log [fp8]=fp8.md)
# Files a phase writes into $OUT besides its log
declare -A EXTRA_FILES=([kernels]=1)
# The command's timeout, the setup before the first phase (pip-installing .whl, session.txt's torch
# import), the grace a phase gets to die at its limit, and the most files of $OUT that are copied
# back.
COMMAND_S=540 SETUP_S=20 GRACE_S=10 FILES_BACK=8
DEADLINE_S=${GPU_SESSION_DEADLINE:-515}
# What ../shared/tools/gpu-wheels.sh always fetches, before the specs of dev/gpu_wheels.txt
BASE_WHEELS="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3"
# Import names the suite uses that the GPU host lacks (its tests skip there); hidden in the dry
# run's collection
HOST_LACKS="datasets wandb hydra_plugins.hydra_submitit_launcher"

# Each phase's commands, through cmd: run, or under --dry-run written down for
# dev/gpu_session_check.py.
cmd() {
  if [ -n "$dry" ]; then printf '%q ' "$@" >> "$checks" && echo >> "$checks"; else "$@"; fi
}
# The fused kernels at the presets' widths (RMSNorm+scale: K = 1, a stock norm, and K = 3, unified's
# q/k/v, at 128 (a head), 1024 (moe-2b), 2048 (dense-1b), 4096; norm+SwiGLU at moe-2b's expert
# width, dense-0.5b's and dense-1b's FFN, shared and per-expert scales) against eager and
# torch.compile, with the table that model.kernels=auto reads (commit it as
# kernels/scalevec_kernels/measured/<date>-<device>.json)
phase_kernels() {  # --profile: each call's host time and its kernels' GPU time beside the wall time
  cmd "$py" scripts/bench_kernels.py --against eager compile --m 16384 --n 128 1024 2048 4096 \
    --k 1 3 --f 512 4096 8192 --experts 0 8 --profile --table "$out/kernels_table.json"
}
# model.kernels=auto (the default); --profile: then the GPU kernels of a step, longest first
phase_train_1b() {
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 \
    --micro-batch 4 --profile
}
phase_train_1b_kernels() {  # unified on the fused kernels alone, then on torch.compile's code alone
  [ -n "$dry" ] || echo "model.kernels=triton"
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales unified --seq-len 4096 \
    --micro-batch 4 -- model.kernels=triton
  local rc=$?
  [ -n "$dry" ] || echo "model.kernels=torch"
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales unified --seq-len 4096 \
    --micro-batch 4 -- model.kernels=torch && return "$rc"
}
phase_moe_2b() {  # where moe-2b's step goes: the GPU kernels of a step, longest first
  cmd "$py" scripts/bench_train.py --presets moe-2b --scales baseline,unified --profile
}
# eight workers share the GPU: their Triton JIT and compilation run side by side
phase_gpu_tests() {
  cmd env SCALEVEC_GPU_TESTS=1 "$py" -m pytest -q -p no:cacheprovider -n 8 tests/gpu
}
# its raw logs stay on the machine (the files back are few); a failure prints their end
phase_torchtitan() {
  cmd "$py" scripts/bench_torchtitan.py --preset dense-1b --seq-len 4096 --micro-batch 4 \
    --warmup 10 --steps 20 --out /tmp/torchtitan_logs
}
phase_train_1b_eager() {  # the fused kernels' share of an uncompiled step, baseline against unified
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 \
    --micro-batch 4 --no-compile --warmup 2 --steps 5
}
phase_train_2b() {  # moe-2b runs whatever dense-2b's outcome; the phase fails if either does
  cmd "$py" scripts/bench_train.py --presets dense-2b --scales baseline --micro-batch 2 \
    -- distributed.activation_checkpointing=full
  local rc=$?
  cmd "$py" scripts/bench_train.py --presets moe-2b --scales baseline && return "$rc"
}
phase_muon() {
  cmd "$py" scripts/bench_train.py --presets dense-1b --scales baseline --seq-len 4096 \
    --micro-batch 4 -- optim=muon
}
# Not in the default plan (its estimate and the default plan's exceed one deadline): FP8
# (model.fp8), dense-1b baseline and unified compiled in bf16, under tensorwise and under rowwise
# (torchao's size filter: model.fp8_filter=auto), as train-1b runs it, then the time of a forward
# and backward of every distinct map shape of dense-0.5b, dense-1b and dense-2b at 16384 tokens in
# bf16 and under each recipe, compiled (last: a limit cuts only its later rows)
phase_fp8() {
  local rc=0 fp8
  for fp8 in none tensorwise rowwise; do
    [ -n "$dry" ] || echo "model.fp8=$fp8"
    cmd "$py" scripts/bench_train.py --presets dense-1b --scales baseline,unified --seq-len 4096 \
      --micro-batch 4 -- model.fp8=$fp8 || rc=1
  done
  cmd "$py" scripts/bench_fp8.py --presets dense-0.5b,dense-1b,dense-2b --m 16384 || rc=1
  return "$rc"
}
# Not in the default plan: the CPU suite on the GPU host (name the phase to run it)
# the CPU suite (GPUs hidden, as on any machine), each test file on one of 12 workers
phase_suite() {
  cmd "$py" -m pytest -q -p no:cacheprovider -n 12 --dist loadfile
}

error() { echo "error: $1" >&2; exit 2; }
limit() { local var=GPU_SESSION_LIMIT_${1^^}; var=${var//-/_}; echo "${!var:-${LIMIT[$1]}}"; }

dry=
[ "${1:-}" = --dry-run ] && { dry=1; shift; }
if [ $# -gt 0 ]; then phases=("$@"); else phases=("${PLAN[@]}"); fi
for name in "${phases[@]}"; do  # every name checked before anything runs
  [ -n "${LIMIT[$name]+x}" ] || error "unknown phase '$name'. Fix: use some of: ${!LIMIT[*]}."
done
for name in "${!LIMIT[@]}"; do
  for table in EST MIN LOG; do
    declare -n entry=$table
    [ -n "${entry[$name]+x}" ] || error "phase '$name' has a limit but no $table entry."
  done
  value=$(limit "$name")
  [[ $value =~ ^[1-9][0-9]*$ ]] ||
    error "the limit of $name is '$value'. Fix: a whole number of seconds."
done
[[ $DEADLINE_S =~ ^[1-9][0-9]*$ ]] ||
  error "GPU_SESSION_DEADLINE is '$DEADLINE_S'. Fix: a whole number of seconds."
# Budgets, before anything runs: a command past its timeout is killed whole (the phase it cuts
# leaves no status line), files past FILES_BACK are not copied back, and a plan estimated past its
# deadline would skip its last phases.
[ $((DEADLINE_S + SETUP_S)) -le "$COMMAND_S" ] ||
  error "the deadline ($DEADLINE_S s) and the setup ($SETUP_S s) \
exceed the command's timeout of $COMMAND_S s. Fix: lower GPU_SESSION_DEADLINE."
files=1
estimate=$SETUP_S
for name in "${phases[@]}"; do
  files=$((files + 1 + ${EXTRA_FILES[$name]:-0}))
  estimate=$((estimate + EST[$name]))
done
[ "$files" -le "$FILES_BACK" ] ||
  error "these phases write $files files into \$OUT; $FILES_BACK are copied \
back. Fix: run fewer phases in one command."
[ "$estimate" -le "$DEADLINE_S" ] ||
  error "the phases' estimates add up to $estimate s with the setup, over the deadline of \
$DEADLINE_S s. Fix: leave out a phase (name the others) and run it in a command of its own."

if [ -n "$dry" ]; then
  py=${PYTHON:-python3}
  [ -n "${PYTHON:-}" ] || [ ! -x .venv/bin/python ] || py=.venv/bin/python
  export PYTHONPATH=$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
  echo "plan: one command, .whl/ in the checkout, under a timeout of $COMMAND_S s: bash \
dev/gpu_session.sh $*"
  printf '  %-16s %9s %6s %5s  %s\n' phase "estimate" limit min "log in \$OUT"
  printf '  %-16s %7d s %6s %5s  %s\n' setup "$SETUP_S" - - session.txt
  end=$SETUP_S
  for name in "${phases[@]}"; do
    end=$((end + EST[$name]))
    printf '  %-16s %7d s %4d s %3d s  %s  (estimated to end at %d s)\n' "$name" "${EST[$name]}" \
      "$(limit "$name")" "${MIN[$name]}" "${LOG[$name]}" "$end"
  done
  echo "  estimates: $estimate s of the $DEADLINE_S s deadline; files back: $files of $FILES_BACK"
  status=0
  missing=()
  specs=($BASE_WHEELS $(cat dev/gpu_wheels.txt))
  shopt -s nocaseglob
  # a wheel's file name starts with the project name, '-' and '.' as '_'
  for spec in "${specs[@]}"; do
    name=${spec%%==*}
    compgen -G ".whl/${name//[-.]/_}-${spec#*==}-*.whl" > /dev/null || missing+=("$spec")
  done
  dupes=$(ls .whl/*.whl 2>/dev/null | sed 's|.*/||; s|-.*||' | tr 'A-Z' 'a-z' | sort | uniq -d |
    tr '\n' ' ')
  [ -z "$dupes" ] ||
    { echo "wheels: .whl/ holds two versions of: $dupes(pip would refuse them all)."; status=2; }
  if [ ${#missing[@]} -eq 0 ]; then
    echo "wheels: .whl/ holds the ${#specs[@]} that gpu-wheels.sh and dev/gpu_wheels.txt name"
  else
    echo "wheels: .whl/ lacks ${missing[*]}. Fix, from the repository root, with the package \
registry:"
    echo "  bash ../shared/tools/gpu-wheels.sh \$(cat dev/gpu_wheels.txt)"
    [ "$status" -ne 0 ] || status=1
  fi
  checks=$(mktemp)
  out=${OUT:-gpu_out}
  for name in "${phases[@]}"; do "phase_${name//-/_}"; done
  echo "commands:"
  "$py" dev/gpu_session_check.py --host-lacks "$HOST_LACKS" < "$checks" || status=2
  rm -f "$checks"
  exit "$status"
fi

# The run, on the GPU machine.
begin=$SECONDS
py=${PYTHON:-python3}
out=${OUT:-gpu_out}
mkdir -p "$out"
report=$out/session.txt
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
# the packages from the checkout, without installing: kernels/ holds scalevec_kernels
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 py out dry
{ date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    2>&1
  echo "plan: ${phases[*]}; deadline ${DEADLINE_S}s after the start"; } > "$report"
cat "$report"
deadline=$(($(date +%s) + DEADLINE_S - (SECONDS - begin)))
for name in "${phases[@]}"; do
  fn=phase_${name//-/_}
  export -f cmd "$fn"
  "$py" dev/gpu_phase.py --name "$name" --limit "$(limit "$name")" --min "${MIN[$name]}" \
    --deadline "$deadline" --grace "$GRACE_S" --log "$out/${LOG[$name]}" --report "$report" \
    --note " estimate=${EST[$name]}s" -- bash -c "$fn"
  [ $? -eq 125 ] && continue  # skipped: too little time left
  echo "== $name (${LOG[$name]})"
  tail -n 25 "$out/${LOG[$name]}"
done
echo "== session.txt ($((SECONDS - begin)) s)"
cat "$report"

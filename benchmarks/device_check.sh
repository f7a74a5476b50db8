#!/usr/bin/env bash
# The one GPU check, a one-shot on a lent GPU: one H200 for 15 minutes of device time in all (its
# start included), torch 2.11 cu130, triton 3.6, no network, and at most 8 files of $OUT back.
# In one call it builds the extension, reports every GPU test, and brings back every number the
# GPU goals need, each next to its goal in summary.md.
#
# Stages, each under its own limit, run as `timeout -s INT --kill-after=15 LIMIT ...`: SIGINT
# first, so pytest prints its summary and a benchmark writes what it measured, then SIGKILL.
# A failed or killed stage never stops the next, and no stage starts past the total budget.
#   toolchain     python, torch, triton, nvcc, gcc, ninja, CUDA_HOME, driver, the card's state and
#                 compute capability, pytest and its plugins (the probes read, never set, the card)
#   build         the CUDA extension in place (setup.py build_ext --inplace, FUSED_ACCUM_BUILD_CUDA=1)
#   gpu-core      pytest -m gpu on the core files, serially: the kernels' GPU checks, graph capture,
#                 the extension, the optimizer, Triton extras, the benchmark plumbing on CUDA
#   gpu-matrix    pytest -m gpu on every other test file (test_kernels, test_nn, ...), -n 8
#   kernels       benchmarks/run.py --suite accumulate,step at GPU sizes: % of a copy timed in the
#                 same run, cuda vs triton vs torch (stops starting groups at its --time-budget)
#   e2e           benchmarks/run.py --suite e2e: the small bf16 GPT's k = 8 window, three ways
#   triton-sweep  benchmarks/triton_sweep.py: BLOCK x num_warps x programs per SM
#   triton-host   benchmarks/triton_host.py: the Triton launcher's host time, kernels stubbed
#   wgrad         benchmarks/wgrad.py --e2e: the fused weight-gradient GEMM against the bf16 GEMM
#   goals         scripts/device_goals.py: launches per op on 2,048 tensors, the k = 8 window's
#                 gradient traffic, and summary.md (every goal: met, MISSED or not measured)
# Only the GPU benchmark suites run (not `window`, the CPU thread table, nor cpu_adam).
#
# Files in $OUT, written as they are measured (a stage killed at its limit leaves what it had),
# exactly these 8: device_check.log (everything printed), summary.md, results.json, kernels.csv,
# end_to_end.csv, triton_sweep.csv, triton_host.csv, wgrad.csv. The rest (junit XML, wgrad.json,
# wgrad_e2e.csv, stages.csv) goes to a scratch folder that summary.md is made from.
#
# Usage, from anywhere:
#   FUSED_ACCUM_GIT_COMMIT=<sha> bash benchmarks/device_check.sh     on the GPU machine
#   bash benchmarks/device_check.sh --budget                          print the stage budget, exit
#   bash benchmarks/device_check.sh --dry-run                         the plumbing on a CPU
# Environment:
#   OUT=DIR        where the 8 files go (the device tool sets it; default build/device_check)
#   PYTHON=...     the interpreter (default python3: on the lent H200 the one with torch)
#   FUSED_ACCUM_GIT_COMMIT=<sha>  the commit stamped on every result (.git does not travel there:
#                  put the sha in the command); else `git rev-parse HEAD`, else "unknown"
#   MAX_JOBS       compile jobs for the build (default: one per core)
# Dry run (--dry-run, or DEVICE_CHECK_DRY_RUN=1; tests/test_device_check.py): no GPU needed. The
# build and the GPU test files get stand-ins (scripts/device_check_standin.py; the pytest stages
# run the real pytest command line on stand-in test files), the triton sweep a stand-in writing
# its CSV, and every CPU-capable stage runs for real at smoke sizes on the CPU. Only there:
#   DEVICE_CHECK_PLANT=stage=fail|hang|hang-hard[,...]  that stage's command exits 3, or sleeps
#                                             until SIGINT, or ignores SIGINT until SIGKILL
#   DEVICE_CHECK_LIMITS=stage=S[,...]         that stage's limit in seconds (default 120 each)
#   DEVICE_CHECK_KILL_AFTER=S                 the SIGKILL grace after SIGINT (default 15)
# Exit status: 0 only if every stage passed; 2 when there is no GPU and no --dry-run.
set -uo pipefail

SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

DRY_RUN=${DEVICE_CHECK_DRY_RUN:-0}
MODE=run
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  --budget) MODE=budget ;;
  --toolchain) MODE=toolchain ;;  # internal: the toolchain stage's body, run under its limit
  "") ;;
  *) echo "usage: bash benchmarks/device_check.sh [--dry-run | --budget]" >&2; exit 2 ;;
esac

PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1  # else python holds its output back and a killed stage logs nothing

# --- the budget: stage, limit in seconds ------------------------------------------------------
# Estimated for a bare H200 machine (16 cores): the build's longest object (csrc/hooks.cpp) takes
# ~40 s here, so ~45 s with 16 jobs; the Triton JIT of every variant the GPU tests reach ~100 s in
# all (issue 21: ~130 elementwise variants at ~0.45 s, the wgrad GEMM's at 1-4 s each, fewer now
# that M is not specialised): the core files compile theirs serially into Triton's disk cache,
# which the matrix's 8 workers then share; the kernel suite is cut by its own --time-budget of
# 35 s (then measures the copy again and writes its files); the sweep stops starting
# configurations after 12 s.
STAGES=(toolchain build gpu-core gpu-matrix kernels e2e triton-sweep triton-host wgrad goals)
declare -A LIMIT=([toolchain]=15 [build]=75 [gpu-core]=95 [gpu-matrix]=85 [kernels]=55 [e2e]=30
                  [triton-sweep]=25 [triton-host]=10 [wgrad]=40 [goals]=30)
KILL_AFTER=15
TOTAL_BUDGET=480  # 8 minutes: a 10-minute command, with a machine start and a rerun's margin

if [[ $DRY_RUN == 1 ]]; then
  for s in "${STAGES[@]}"; do LIMIT[$s]=120; done
  KILL_AFTER=${DEVICE_CHECK_KILL_AFTER:-15}
  IFS=',' read -r -a pairs <<<"${DEVICE_CHECK_LIMITS:-}"
  for pair in "${pairs[@]}"; do
    [[ -z $pair ]] && continue
    [[ -n ${LIMIT[${pair%%=*}]+x} ]] || { echo "DEVICE_CHECK_LIMITS: no stage ${pair%%=*}" >&2; exit 2; }
    LIMIT[${pair%%=*}]=${pair#*=}
  done
fi
budget=0
for s in "${STAGES[@]}"; do budget=$((budget + LIMIT[$s])); done
budget=$((budget + KILL_AFTER))  # the last stage's SIGKILL grace; earlier overruns shorten later stages
[[ $DRY_RUN == 1 ]] && TOTAL_BUDGET=$budget

print_budget() {
  echo "=== budget: each stage's limit (timeout -s INT --kill-after=$KILL_AFTER), in order"
  for s in "${STAGES[@]}"; do printf '    %-13s %4d s\n' "$s" "${LIMIT[$s]}"; done
  echo "    + $KILL_AFTER s of SIGKILL grace for the last stage = $budget s of $TOTAL_BUDGET s; a stage that runs"
  echo "      over its limit shortens the later ones, so the run ends within $TOTAL_BUDGET s"
}
if [[ $MODE == budget ]]; then
  print_budget
  [[ $budget -le $TOTAL_BUDGET ]] || { echo "budget: $budget s is over $TOTAL_BUDGET s"; exit 1; }
  exit 0
fi

# --- the toolchain stage's body ----------------------------------------------------------------
probe() {  # probe LABEL CMD...: one line (or a few) of a read-only probe, never more than 8 s
  local label=$1
  shift
  printf '%-16s ' "$label:"
  timeout -k 2 8 "$@" 2>&1 | head -n 6 | tr '\n' ' ' || true
  echo
}
if [[ $MODE == toolchain ]]; then
  probe python "$PY" -c "import sys; print(sys.executable, sys.version.split()[0])"
  probe torch "$PY" -W ignore -c "import torch; print(torch.__version__, '| CUDA', torch.version.cuda, '| cxx11 abi', torch.compiled_with_cxx11_abi())"
  probe device "$PY" -W ignore -c "import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, '| compute capability', f'{p.major}.{p.minor}', '|', p.multi_processor_count, 'SMs |', round(p.total_memory / 2**30), 'GiB')
else:
    print('no CUDA device')"
  probe triton "$PY" -c "import triton; print(triton.__version__)"
  probe nvcc bash -c "command -v nvcc && nvcc --version | tail -n 2"
  probe CUDA_HOME bash -c "echo \"${CUDA_HOME:-unset}; /usr/local/cuda: \$(readlink -f /usr/local/cuda 2>/dev/null || echo absent)\""
  probe gcc bash -c "gcc --version | head -n 1"
  probe ninja ninja --version
  probe driver nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw,compute_cap --format=csv,noheader
  probe pytest "$PY" -c "import importlib.metadata as m
names = ('pytest', 'pytest-xdist', 'pytest-timeout', 'hypothesis', 'numpy', 'setuptools', 'ninja')
def version(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return 'missing'
print(', '.join(f'{n} {version(n)}' for n in names))"
  probe cores nproc
  exit 0
fi

# --- the run -----------------------------------------------------------------------------------
OUT="${OUT:-$ROOT/build/device_check}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/device_check.log"
: >"$LOG"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")
STAGES_CSV="$SCRATCH/stages.csv"
echo "stage,outcome,exit,seconds,limit" >"$STAGES_CSV"
START=$SECONDS
DEADLINE=$((START + TOTAL_BUDGET))
status=0
summary=()

say() { echo "$*" | tee -a "$LOG"; }

if [[ $DRY_RUN != 1 ]] && { ! command -v nvidia-smi >/dev/null || ! timeout 10 nvidia-smi -L >/dev/null 2>&1; }; then
  say "device_check: no NVIDIA GPU here (nvidia-smi finds none); on a CPU run: bash benchmarks/device_check.sh --dry-run"
  exit 2
fi
if [[ -z "${FUSED_ACCUM_GIT_COMMIT:-}" ]]; then
  FUSED_ACCUM_GIT_COMMIT=$(timeout 10 git rev-parse HEAD 2>/dev/null || echo unknown)
fi
export FUSED_ACCUM_GIT_COMMIT  # benchmarks/common.py stamps every result with it

declare -A PLANT=()
if [[ $DRY_RUN == 1 ]]; then
  IFS=',' read -r -a pairs <<<"${DEVICE_CHECK_PLANT:-}"
  for pair in "${pairs[@]}"; do
    [[ -z $pair ]] && continue
    [[ -n ${LIMIT[${pair%%=*}]+x} ]] || { say "DEVICE_CHECK_PLANT: no stage ${pair%%=*}"; exit 2; }
    PLANT[${pair%%=*}]=${pair#*=}
  done
fi

# pytest: every outcome named (-v), failures, errors and skips summarised (-rfEs), one hang one
# failure (--timeout, where pytest-timeout is installed), a file that fails to import reported
# without stopping the others, tests/integration (transformers, accelerate, lightning) left out.
PYTEST=("$PY" -m pytest -m gpu -v -rfEs -p no:cacheprovider --continue-on-collection-errors --durations=10
        --ignore=tests/integration)
if timeout 20 "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=90); fi
XDIST=()
if timeout 20 "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
CORE_TESTS=(tests/test_gpu_kernels.py tests/test_optimizer_gpu.py tests/test_ext.py tests/test_optimizer.py
            tests/test_triton_extra.py tests/test_benchmarks.py)
if [[ $DRY_RUN == 1 ]]; then
  timeout 30 "$PY" scripts/device_check_standin.py write-tests "$SCRATCH/standin-tests"
fi

stage_command() {  # sets CMD (and POST, run after CMD whatever its outcome) for stage $1
  POST=()
  local dry=$DRY_RUN
  case $1 in
    toolchain) CMD=(bash "$SELF" --toolchain) ;;
    build)
      if [[ $dry == 1 ]]; then CMD=("$PY" scripts/device_check_standin.py build "$ROOT")
      else
        CMD=(env FUSED_ACCUM_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py build_ext --inplace)
      fi ;;  # (which backends the later stages found, and why not, heads summary.md)
    gpu-core)
      if [[ $dry == 1 ]]; then CMD=("${PYTEST[@]}" --junitxml="$SCRATCH/gpu-core.xml" "$SCRATCH/standin-tests/core")
      else CMD=("${PYTEST[@]}" --junitxml="$SCRATCH/gpu-core.xml" "${CORE_TESTS[@]}")
      fi ;;
    gpu-matrix)
      local ignore=()
      for f in "${CORE_TESTS[@]}"; do ignore+=(--ignore="$f"); done
      if [[ $dry == 1 ]]; then
        CMD=("${PYTEST[@]}" "${XDIST[@]}" --junitxml="$SCRATCH/gpu-matrix.xml" "$SCRATCH/standin-tests/matrix")
      else CMD=("${PYTEST[@]}" "${XDIST[@]}" --junitxml="$SCRATCH/gpu-matrix.xml" "${ignore[@]}" tests)
      fi ;;
    kernels)
      if [[ $dry == 1 ]]; then
        CMD=("$PY" benchmarks/run.py --smoke --device cpu --threads 1 --suite accumulate,step --out "$OUT" --no-plot)
      else CMD=("$PY" benchmarks/run.py --suite accumulate,step --out "$OUT" --no-plot --time-budget 35)
      fi ;;
    e2e)  # its own folder: run.py writes a results.json of its own, which must not replace the kernels'
      if [[ $dry == 1 ]]; then
        CMD=("$PY" benchmarks/run.py --smoke --device cpu --threads 1 --suite e2e --out "$SCRATCH/e2e" --no-plot)
      else CMD=("$PY" benchmarks/run.py --suite e2e --out "$SCRATCH/e2e" --no-plot)
      fi
      POST=(cp "$SCRATCH/e2e/end_to_end.csv" "$OUT/") ;;
    triton-sweep)
      if [[ $dry == 1 ]]; then CMD=("$PY" scripts/device_check_standin.py triton-sweep "$OUT")
      else CMD=("$PY" benchmarks/triton_sweep.py --out "$OUT" --budget 12)
      fi ;;
    triton-host)
      if [[ $dry == 1 ]]; then CMD=("$PY" benchmarks/triton_host.py --out "$OUT" --tensors 148 --repeat 5)
      else CMD=("$PY" benchmarks/triton_host.py --out "$OUT" --repeat 50)
      fi ;;
    wgrad)  # wgrad.csv into $OUT a row at a time; its json and e2e rows stay behind (8 files back)
      if [[ $dry == 1 ]]; then
        CMD=("$PY" -m benchmarks.wgrad --smoke --device cpu --e2e --out "$OUT" --extra-out "$SCRATCH")
      else CMD=("$PY" -m benchmarks.wgrad --device cuda --e2e --out "$OUT" --extra-out "$SCRATCH")
      fi ;;
    goals)
      if [[ $dry == 1 ]]; then
        CMD=("$PY" scripts/device_goals.py --out "$OUT" --scratch "$SCRATCH" --device cpu --smoke --dry-run)
      else CMD=("$PY" scripts/device_goals.py --out "$OUT" --scratch "$SCRATCH")
      fi ;;
  esac
  case "${PLANT[$1]:-}" in
    fail) CMD=("$PY" -c "import sys; print('planted failure (DEVICE_CHECK_PLANT)'); sys.exit(3)") ;;
    hang) CMD=("$PY" -c "import time; print('planted hang (DEVICE_CHECK_PLANT)', flush=True); time.sleep(10**6)") ;;
    hang-hard)  # deaf to SIGINT, as a process stuck in a driver call can be: only SIGKILL ends it
      CMD=("$PY" -c "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN)
print('planted hang that ignores SIGINT (DEVICE_CHECK_PLANT)', flush=True); time.sleep(10**6)") ;;
    "") ;;
    *) say "DEVICE_CHECK_PLANT: $1=${PLANT[$1]}: plant fail, hang or hang-hard"; exit 2 ;;
  esac
}

run_stage() {  # run_stage NAME: its command under its limit, logged; the outcome recorded
  local name=$1 limit=${LIMIT[$1]} left t0 rc outcome
  left=$((DEADLINE - SECONDS - KILL_AFTER))
  ((left < limit)) && limit=$left
  if ((limit < 1)); then
    say "=== $name: not started, the ${TOTAL_BUDGET} s budget is spent"
    echo "$name,not started (budget spent),-,0,0" >>"$STAGES_CSV"
    summary+=("$(printf '%-13s not started (budget spent)' "$name")")
    status=1
    return
  fi
  stage_command "$name"
  say "=== $name (limit $limit s, at $((SECONDS - START)) s): ${CMD[*]}"
  t0=$SECONDS
  timeout -s INT --kill-after="$KILL_AFTER" "$limit" "${CMD[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if ((${#POST[@]})); then "${POST[@]}" 2>&1 | tee -a "$LOG"; fi
  case $rc in
    0) outcome=ok ;;
    124) outcome="killed at its $limit s limit (SIGINT)" ;;
    137) outcome="killed at its $limit s limit (SIGKILL after $KILL_AFTER s)" ;;
    *) outcome=FAILED ;;
  esac
  say "=== $name: $outcome, exit $rc after $((SECONDS - t0)) s"
  echo "$name,$outcome,$rc,$((SECONDS - t0)),$limit" >>"$STAGES_CSV"
  summary+=("$(printf '%-13s %-45s exit %3d %4d s' "$name" "$outcome" "$rc" "$((SECONDS - t0))")")
  [[ $rc -eq 0 ]] || status=1  # a failed stage never stops the next
}

say "=== device_check $( [[ $DRY_RUN == 1 ]] && echo '(DRY RUN: CPU stand-ins for the GPU work) ')at $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $FUSED_ACCUM_GIT_COMMIT, out $OUT"
print_budget | tee -a "$LOG"
for stage in "${STAGES[@]}"; do run_stage "$stage"; done

if [[ ! -s $OUT/summary.md ]]; then  # the goals stage failed early: still one summary, from the stages
  { echo "# GPU check summary"; echo; echo "The goals stage wrote none (see device_check.log). The stages:"; echo
    tail -n +2 "$STAGES_CSV" | sed 's/^/- /'; } >"$OUT/summary.md"
fi
say "=== device_check summary"
for line in "${summary[@]}"; do say "    $line"; done
files=$(find "$OUT" -mindepth 1 | wc -l)
say "=== total $((SECONDS - START)) s of $TOTAL_BUDGET; $files files in $OUT (at most 8 come back):"
ls -l "$OUT" 2>&1 | tee -a "$LOG"
((files <= 8)) || say "device_check: WARNING: more than 8 files in $OUT: the log may not come back"
rm -rf "$SCRATCH"
exit $status

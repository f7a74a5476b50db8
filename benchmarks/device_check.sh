#!/usr/bin/env bash
# The one GPU check, a one-shot on a lent GPU: one H200 for 15 minutes of device time in all (its
# start included), torch 2.11 cu130, triton 3.6, no network, and at most 8 files of $OUT back.
# In one call it builds the extension, reports every GPU test, and brings back every number the
# GPU goals need, each next to its goal in summary.md.
#
# Stages, each under its own limit, run as `timeout -s INT --kill-after=15 LIMIT ...`: SIGINT
# first, so pytest prints its summary and a benchmark writes what it measured, then SIGKILL.
# (GNU timeout gives its child SIGINT's default action even when this script was started with
# SIGINT ignored, as a background job of another script is; the Python benchmarks restore
# Python's handler themselves too: tests/test_device_check.py runs the dry run that way.)
# A failed or killed stage never stops the next, and no stage starts past the total budget.
# The first nvidia-smi on a cold machine takes ~60 s (the driver brings the card up): it runs in
# the background from the start (`nvidia-smi -L`), overlapping the toolchain and build stages,
# which need no GPU. Before the device stage the run waits for it, outside that stage's clock, but
# never past the end of the toolchain and build stages' limits (70 s from the start): the wait
# takes only the time those two left unused, so the budget holds. (It once counted in the device
# stage's 25 s, which a cold machine's nvidia-smi alone could exceed.)
#   toolchain     python, torch, triton, nvcc, gcc, ninja, CUDA_HOME, pytest and its plugins, cores
#   build         the CUDA extension in place (setup.py build_ext --inplace, FUSED_ACCUM_BUILD_CUDA=1,
#                 CFLAGS/CXXFLAGS -g0: the -g that Python's flags add doubles csrc/hooks.cpp's
#                 compile time, 58 s against 28 s)
#   device        the background nvidia-smi -L's answer (waited for before the stage, see above;
#                 what is still left of it, inside the stage), then the card: name, compute
#                 capability, driver, clocks, temperature (the probes read, never set, the card)
#   gpu-core      pytest -m gpu on the core files, serially (-n 1 under pytest-xdist, so that a test
#                 that hangs past --timeout ends its worker, not the stage): the kernels' GPU checks,
#                 graph capture, the extension, the optimizer, the benchmark plumbing (its smoke run
#                 on CUDA), then the Triton extras
#   gpu-matrix    pytest -m gpu on every other test file (test_kernels, test_nn, ...), -n 8
#   kernels       benchmarks/run.py --suite accumulate,step at GPU sizes: % of a copy timed in the
#                 same run, cuda vs triton vs torch (the goals' groups first; stops starting groups
#                 at its --time-budget)
#   e2e           benchmarks/run.py --suite e2e: the small bf16 GPT's k = 8 window, three ways
#   triton-sweep  benchmarks/triton_sweep.py: BLOCK, num_warps, programs per SM, one at a time
#   triton-host   benchmarks/triton_host.py: the Triton launcher's host time, kernels stubbed
#   wgrad         benchmarks/wgrad.py --e2e: the fused weight-gradient GEMM against the bf16 GEMM
#   offload       benchmarks/offload.py: the host step per bucket; a k = 8 window of a small bf16 GPT with and
#                 without offload='cpu' (ms, peak device memory, the optimizer's device bytes per
#                 parameter, how much of the host step hides, speculations committed and redone)
#   gpu-compile   (only where named: see ORDER below) pytest -m gpu tests/test_compiled_window.py
#   compile       (only where named) benchmarks/compile.py under mode="reduce-overhead"
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
#   bash benchmarks/device_check.sh --commands                        print each stage's command, exit
#   bash benchmarks/device_check.sh --dry-run                         the plumbing on a CPU
# A targeted rerun (the whole run does not fit twice in the 15 minutes): name the stages, e.g.
#   DEVICE_CHECK_STAGES=build,gpu-core,goals FUSED_ACCUM_GIT_COMMIT=<sha> bash benchmarks/device_check.sh
# runs those alone, in the usual order (`--budget` with it prints their limits: that one is 225 s).
# Include `build` in a rerun: a rerun on a fresh machine does not find the first run's extension
# (build outputs need not be there), and without it every cuda-backend test skips. Include `goals`
# for a summary.md; it reads only what this run's stages left, so the goals of the stages not
# rerun read "not measured". An unknown stage name is an error (exit 2), before anything runs.
# Environment:
#   OUT=DIR        where the 8 files go (the device tool sets it; default build/device_check)
#   PYTHON=...     the interpreter (default python3: on the lent H200 the one with torch)
#   FUSED_ACCUM_GIT_COMMIT=<sha>  the commit stamped on every result (.git does not travel there:
#                  put the sha in the command); else `git rev-parse HEAD`, else "unknown"
#   MAX_JOBS       compile jobs for the build (default: one per core)
#   DEVICE_CHECK_STAGES=stage[,stage...]  run only these stages (see above; default: all)
# Dry run (--dry-run, or DEVICE_CHECK_DRY_RUN=1; tests/test_device_check.py): no GPU needed. The
# build and the GPU test files get stand-ins (scripts/device_check_standin.py; the pytest stages
# run the real pytest command line on stand-in test files), the triton sweep a stand-in writing
# its CSV, and every CPU-capable stage runs for real at smoke sizes on the CPU. Only there:
#   DEVICE_CHECK_PLANT=stage=fail|hang|hang-hard[,...]  that stage's command exits 3, or sleeps
#                                             until SIGINT, or ignores SIGINT until SIGKILL
#   DEVICE_CHECK_LIMITS=stage=S[,...]         that stage's limit in seconds (default 120 each)
#   DEVICE_CHECK_KILL_AFTER=S                 the SIGKILL grace after SIGINT (default 15)
#   DEVICE_CHECK_WARMUP_S=S                   the stand-in nvidia-smi -L's seconds (default 2)
# Exit status: 0 only if every stage passed; 2 when there is no GPU and no --dry-run (no
# nvidia-smi: at once; nvidia-smi -L names no GPU: after the device stage, the rest not started).
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
  --device) MODE=device ;;  # internal: the device stage's body, run under its limit
  --commands) MODE=commands ;;
  "") ;;
  *) echo "usage: bash benchmarks/device_check.sh [--dry-run | --budget | --commands]" >&2; exit 2 ;;
esac

PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1  # else python holds its output back and a killed stage logs nothing

# --- the budget: stage, limit in seconds ------------------------------------------------------
# Estimated for a bare H200 machine (16 cores; issue 26 section 4): the toolchain's probes ~10 s
# (python and torch imports, no GPU); the build's longest object (csrc/hooks.cpp) 28 s with -g0
# (58 s with -g), the others compiled beside it by 16 jobs, then the link; the first nvidia-smi
# ~60 s on a cold machine, from the start, so the run waits before the device stage for what the
# toolchain and build did not cover (outside the device stage's clock, at most until their limits
# end: 70 s from the start), then the stage probes the card (~5 s); the Triton JIT of every
# variant the GPU tests reach ~100 s in all (~130 elementwise variants at ~0.45 s, the wgrad
# GEMM's at 1-4 s each): the core files compile theirs serially into Triton's disk cache,
# 110-120 s with the tests (the 500-tensor remainder test is ~1 s since it checks on
# concatenations; it was 40-65 s: issue 34), which the matrix's 8 workers then share; the matrix
# holds 372 tests, 50-70 s (issue 34): 80; the kernel suite is cut by its own --time-budget of
# 30 s (then measures the copy again and writes its files); the sweep stops starting
# configurations after 10 s; the launcher host time ~15 s; the goals stage counts launches
# (23 s measured on a step that synced per parameter, issue 26 section 1) and times the window's
# traffic: 40-45 s.
ALL_STAGES=(toolchain build device gpu-core gpu-matrix kernels e2e triton-sweep triton-host wgrad offload goals)
# Stages that run only where DEVICE_CHECK_STAGES names them (they do not fit beside the others:
# inductor compiles every graph they run). Their own run, 485 s of the 500:
#   DEVICE_CHECK_STAGES=build,device,gpu-compile,compile,goals
#   gpu-compile  pytest -m gpu tests/test_compiled_window.py (left out of gpu-matrix): the window
#                compiled whole under mode="reduce-overhead" replays one CUDA graph per window, bit
#                for bit with it compiled without CUDA graphs (three inductor compiles per case)
#   compile      benchmarks/compile.py on a GPT-2-small-like model (d 768, 12 heads, 4 layers, vocab
#                8192, 128 tokens) at micro-batch 1, 2 and 4 (k = 4, bf16): the eager loop,
#                compile(model) and the one-graph window, fused_accum against torch.optim's best,
#                under mode="reduce-overhead", with the CUDA graph replays per window counted; its
#                goal (the one-graph window >= 1.3x the eager loop) is in summary.md. The one-graph
#                window holds k forwards and backwards (minutes to compile at 12 layers, so 4 here);
#                it starts no size after 150 s
ORDER=(toolchain build device gpu-core gpu-matrix kernels e2e triton-sweep triton-host wgrad offload gpu-compile compile goals)
declare -A LIMIT=([toolchain]=20 [build]=50 [device]=15 [gpu-core]=115 [gpu-matrix]=80 [kernels]=45
                  [e2e]=25 [triton-sweep]=20 [triton-host]=15 [wgrad]=35 [offload]=20 [gpu-compile]=120
                  [compile]=240 [goals]=45)
KILL_AFTER=15
TOTAL_BUDGET=500  # 8 1/3 minutes: a 10-minute command (the machine's start is not in it), 100 s to spare

# DEVICE_CHECK_STAGES: the stages to run (a targeted rerun), in the usual order whatever the
# order named; an unknown name is an error before anything runs
STAGES=("${ALL_STAGES[@]}")
if [[ -n ${DEVICE_CHECK_STAGES:-} ]]; then
  declare -A WANTED=()
  IFS=',' read -r -a names <<<"$DEVICE_CHECK_STAGES"
  for name in "${names[@]}"; do
    name=${name//[[:space:]]/}
    [[ -z $name ]] && continue
    if [[ -z ${LIMIT[$name]+x} ]]; then
      echo "DEVICE_CHECK_STAGES: no stage '$name'; the stages are: $(IFS=,; echo "${ORDER[*]}")" >&2
      exit 2
    fi
    WANTED[$name]=1
  done
  STAGES=()
  for s in "${ORDER[@]}"; do [[ -n ${WANTED[$s]:-} ]] && STAGES+=("$s"); done
  if ((${#STAGES[@]} == 0)); then
    echo "DEVICE_CHECK_STAGES='$DEVICE_CHECK_STAGES' names no stage; the stages are: $(IFS=,; echo "${ORDER[*]}")" >&2
    exit 2
  fi
fi

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
WARMUP_CAP=0  # the wait for the background nvidia-smi -L ends at most this many seconds from the start:
for s in "${STAGES[@]}"; do  # where the limits of the stages before the device stage end
  [[ $s == device ]] && break
  WARMUP_CAP=$((WARMUP_CAP + LIMIT[$s]))
done
for s in "${STAGES[@]}"; do budget=$((budget + LIMIT[$s])); done
budget=$((budget + KILL_AFTER))  # the last stage's SIGKILL grace; earlier overruns shorten later stages
[[ $DRY_RUN == 1 ]] && TOTAL_BUDGET=$budget

print_budget() {
  echo "=== budget: each stage's limit (timeout -s INT --kill-after=$KILL_AFTER), in order"
  if [[ -n ${DEVICE_CHECK_STAGES:-} ]]; then
    echo "    (only the stages DEVICE_CHECK_STAGES names: $(IFS=,; echo "${STAGES[*]}"))"
  fi
  for s in "${STAGES[@]}"; do printf '    %-13s %4d s\n' "$s" "${LIMIT[$s]}"; done
  echo "    + $KILL_AFTER s of SIGKILL grace for the last stage = $budget s of $TOTAL_BUDGET s; a stage that runs"
  echo "      over its limit shortens the later ones, so the run ends within $TOTAL_BUDGET s"
  echo "    the first nvidia-smi (~60 s on a cold machine) runs in the background from the start, beside the"
  if [[ " ${STAGES[*]} " == *" device "* ]]; then
    echo "      stages before the device stage (no GPU needed); the run waits for it before the device stage,"
    echo "      outside that stage's clock, at most until $WARMUP_CAP s from the start (where those stages' limits end),"
    echo "      and the device stage waits for what is left within its own limit"
  else
    echo "      stages (no device stage here: nothing waits for it, and nothing stops the GPU stages without a GPU)"
  fi
}
if [[ $MODE == budget ]]; then
  print_budget
  [[ $budget -le $TOTAL_BUDGET ]] || { echo "budget: $budget s is over $TOTAL_BUDGET s"; exit 1; }
  exit 0
fi

# --- the toolchain and device stages' bodies ---------------------------------------------------
probe() {  # probe LABEL CMD...: one line (or a few) of a read-only probe, never more than 8 s
  local label=$1
  shift
  printf '%-16s ' "$label:"
  timeout -k 2 8 "$@" 2>&1 | head -n 6 | tr '\n' ' ' || true
  echo
}
if [[ $MODE == device ]]; then  # DEVICE_CHECK_WARMUP: the background nvidia-smi -L's files
  waited=0
  until [[ -s ${DEVICE_CHECK_WARMUP:?}.rc ]]; do sleep 0.5; waited=$((waited + 1)); done
  read -r warm_rc warm_s <"$DEVICE_CHECK_WARMUP.rc"
  printf '%-16s ' "nvidia-smi -L:"
  echo "exit $warm_rc after $warm_s s from the start (waited $((waited / 2)) s here): $(head -n 4 "$DEVICE_CHECK_WARMUP" | tr '\n' ' ')"
  probe device "$PY" -W ignore -c "import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, '| compute capability', f'{p.major}.{p.minor}', '|', p.multi_processor_count, 'SMs |', round(p.total_memory / 2**30), 'GiB')
else:
    print('no CUDA device')"
  probe driver nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw,compute_cap --format=csv,noheader
  exit 0
fi
if [[ $MODE == toolchain ]]; then  # nothing here touches the GPU (the device stage does)
  probe python "$PY" -c "import sys; print(sys.executable, sys.version.split()[0])"
  probe torch "$PY" -W ignore -c "import torch; print(torch.__version__, '| CUDA', torch.version.cuda, '| cxx11 abi', torch.compiled_with_cxx11_abi())"
  probe triton "$PY" -c "import triton; print(triton.__version__)"
  probe nvcc bash -c "command -v nvcc && nvcc --version | tail -n 2"
  probe CUDA_HOME bash -c "echo \"${CUDA_HOME:-unset}; /usr/local/cuda: \$(readlink -f /usr/local/cuda 2>/dev/null || echo absent)\""
  probe gcc bash -c "gcc --version | head -n 1"
  probe ninja ninja --version
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
say() { echo "$*" | tee -a "$LOG"; }
if [[ $MODE == commands ]]; then  # print what each stage of the real run would run, run nothing
  OUT='$OUT' SCRATCH='$SCRATCH' LOG=/dev/null NO_GPU=""
else
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
  if [[ $DRY_RUN != 1 ]] && ! command -v nvidia-smi >/dev/null; then
    say "device_check: no NVIDIA GPU here (no nvidia-smi); on a CPU run: bash benchmarks/device_check.sh --dry-run"
    exit 2
  fi
  # The first nvidia-smi, in the background from here: on a cold machine it takes ~60 s, which the
  # toolchain and build stages (no GPU needed) cover; the run waits for its .rc file before the
  # device stage (wait_for_warmup). The dry run stands in with a 2-second wait (DEVICE_CHECK_WARMUP_S)
  # that names no GPU.
  WARMUP="$SCRATCH/nvidia-smi-L.txt"
  export DEVICE_CHECK_WARMUP=$WARMUP
  (
    t0=$SECONDS
    if [[ $DRY_RUN == 1 ]]; then
      sleep "${DEVICE_CHECK_WARMUP_S:-2}"; echo "dry run: no nvidia-smi -L (stand-in)" >"$WARMUP"; rc=0
    else timeout -k 5 120 nvidia-smi -L >"$WARMUP" 2>&1; rc=$?
    fi
    echo "$rc $((SECONDS - t0))" >"$WARMUP.rc.tmp" && mv "$WARMUP.rc.tmp" "$WARMUP.rc"
  ) &
  WARMUP_PID=$!
  NO_GPU=""  # set after the device stage when nvidia-smi -L answered and named no GPU
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

# pytest: every outcome named (-v), failures, errors and skips summarised (-rfEs), a file that
# fails to import reported without stopping the others, tests/integration (transformers,
# accelerate, lightning) left out. One hang is one named failure: the stacks of every thread are
# dumped after 30 s (faulthandler), and where pytest-timeout is installed (it is on the lent
# H200) a test still running at 40 s ends its process (--timeout-method=thread: the signal method
# cannot interrupt a hang inside a CUDA call), which under pytest-xdist is its worker, reported as
# that test's failure while the stage goes on with a new worker: the core stage runs -n 1 for
# that, the matrix -n 8. (A --timeout of 90 could never fire inside stages of 65-115 s.)
PYTEST=("$PY" -m pytest -m gpu -v -rfEs -p no:cacheprovider --continue-on-collection-errors --durations=10
        -o faulthandler_timeout=30 --ignore=tests/integration)
LONG_TESTS=()  # (the gpu-compile stage's tests compile with inductor: 110 s each where pytest-timeout is)
if timeout 20 "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=40 --timeout-method=thread); LONG_TESTS=(--timeout=110); fi
XDIST=()
SERIAL=()
if timeout 20 "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); SERIAL=(-n 1 --max-worker-restart=8); fi
# (test_benchmarks.py's smoke run on CUDA before the Triton extras: a stage cut at its limit cuts
# the last file)
CORE_TESTS=(tests/test_gpu_kernels.py tests/test_optimizer_gpu.py tests/test_ext.py tests/test_optimizer.py
            tests/test_benchmarks.py tests/test_triton_extra.py)
COMPILE_TESTS=(tests/test_compiled_window.py)  # (the gpu-compile stage's: inductor compiles each case)
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
      else  # -g0 after Python's -g (CFLAGS replaces or extends it, by setuptools version): no debug info
        CMD=(env FUSED_ACCUM_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" CFLAGS="-DNDEBUG -fwrapv -g0"
             CXXFLAGS="-DNDEBUG -fwrapv -g0" "$PY" setup.py build_ext --inplace)
      fi ;;  # (which backends the later stages found, and why not, heads summary.md)
    device) CMD=(bash "$SELF" --device) ;;
    gpu-core)
      if [[ $dry == 1 ]]; then
        CMD=("${PYTEST[@]}" "${SERIAL[@]}" --junitxml="$SCRATCH/gpu-core.xml" "$SCRATCH/standin-tests/core")
      else CMD=("${PYTEST[@]}" "${SERIAL[@]}" --junitxml="$SCRATCH/gpu-core.xml" "${CORE_TESTS[@]}")
      fi ;;
    gpu-matrix)
      local ignore=()
      for f in "${CORE_TESTS[@]}" "${COMPILE_TESTS[@]}"; do ignore+=(--ignore="$f"); done
      if [[ $dry == 1 ]]; then
        CMD=("${PYTEST[@]}" "${XDIST[@]}" --junitxml="$SCRATCH/gpu-matrix.xml" "$SCRATCH/standin-tests/matrix")
      else CMD=("${PYTEST[@]}" "${XDIST[@]}" --junitxml="$SCRATCH/gpu-matrix.xml" "${ignore[@]}" tests)
      fi ;;
    kernels)
      if [[ $dry == 1 ]]; then
        CMD=("$PY" benchmarks/run.py --smoke --device cpu --threads 1 --suite accumulate,step --out "$OUT" --no-plot)
      else CMD=("$PY" benchmarks/run.py --suite accumulate,step --out "$OUT" --no-plot --time-budget 30)
      fi ;;
    e2e)  # its own folder: run.py writes a results.json of its own, which must not replace the kernels'
      if [[ $dry == 1 ]]; then
        CMD=("$PY" benchmarks/run.py --smoke --device cpu --threads 1 --suite e2e --out "$SCRATCH/e2e" --no-plot)
      else CMD=("$PY" benchmarks/run.py --suite e2e --out "$SCRATCH/e2e" --no-plot)
      fi
      POST=(cp "$SCRATCH/e2e/end_to_end.csv" "$OUT/") ;;
    triton-sweep)
      if [[ $dry == 1 ]]; then CMD=("$PY" scripts/device_check_standin.py triton-sweep "$OUT")
      else CMD=("$PY" benchmarks/triton_sweep.py --out "$OUT" --budget 10)
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
    offload)  # offload.csv stays in the scratch folder (8 files back): summary.md reports it
      if [[ $dry == 1 ]]; then CMD=("$PY" benchmarks/offload.py --quick --out "$SCRATCH")
      else CMD=("$PY" benchmarks/offload.py --out "$SCRATCH")
      fi ;;
    gpu-compile)  # (on the CPU of the dry run, its GPU tests skip: the command line is what it checks)
      CMD=("${PYTEST[@]}" "${LONG_TESTS[@]}" --junitxml="$SCRATCH/gpu-compile.xml" "${COMPILE_TESTS[@]}") ;;
    compile)  # compile.csv stays in the scratch folder: its tables are in the log, its goal in summary.md
      if [[ $dry == 1 ]]; then
        CMD=("$PY" benchmarks/compile.py --smoke --device cpu --threads 1 --micro-batch 1 --csv "$SCRATCH/compile.csv")
      else
        CMD=("$PY" benchmarks/compile.py --device cuda --mode reduce-overhead --dtype bf16 --d 768 --heads 12
             --layers 4 --vocab 8192 --seq 128 --k 4 --micro-batch 1,2,4 --recipes eager,compile_model,one_graph
             --rounds 20 --time-budget 150 --csv "$SCRATCH/compile.csv")
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
  if [[ -n $NO_GPU ]]; then
    say "=== $name: not started, no GPU ($NO_GPU)"
    echo "$name,not started (no GPU),-,0,0" >>"$STAGES_CSV"
    summary+=("$(printf '%-13s not started (no GPU)' "$name")")
    return
  fi
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

if [[ $MODE == commands ]]; then
  for stage in "${STAGES[@]}"; do stage_command "$stage"; printf '%-13s %s\n' "$stage:" "${CMD[*]}"; done
  exit 0
fi

wait_for_warmup() {  # before the device stage, outside its clock: at most until WARMUP_CAP s from the start
  local t0=$SECONDS
  until [[ -s $WARMUP.rc ]] || ((SECONDS - START >= WARMUP_CAP)); do sleep 0.5; done
  if [[ -s $WARMUP.rc ]]; then
    say "=== before the device stage, waited $((SECONDS - t0)) s for the background nvidia-smi -L (answered)"
  else
    say "=== before the device stage, waited $((SECONDS - t0)) s for the background nvidia-smi -L: no answer by" \
        "$WARMUP_CAP s from the start; the device stage waits for it within its limit"
  fi
}

say "=== device_check $( [[ $DRY_RUN == 1 ]] && echo '(DRY RUN: CPU stand-ins for the GPU work) ')at $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $FUSED_ACCUM_GIT_COMMIT, out $OUT"
print_budget | tee -a "$LOG"
for stage in "${STAGES[@]}"; do
  [[ $stage == device && -z $NO_GPU ]] && wait_for_warmup
  run_stage "$stage"
  if [[ $stage == device && $DRY_RUN != 1 && -s $WARMUP.rc ]]; then
    read -r warm_rc _ <"$WARMUP.rc"
    if [[ $warm_rc != 0 ]] || ! grep -q '^GPU [0-9]' "$WARMUP"; then  # it answered: there is no GPU
      NO_GPU="nvidia-smi -L: exit $warm_rc, $(head -n 2 "$WARMUP" | tr '\n' ' ')"
      say "device_check: no NVIDIA GPU here ($NO_GPU); on a CPU run: bash benchmarks/device_check.sh --dry-run"
      status=2
    fi
  fi
done
wait "$WARMUP_PID" 2>/dev/null  # long done (its timeout is 125 s at most): nothing left running

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

#!/usr/bin/env bash
# The one GPU check: on a machine with an NVIDIA GPU, in one call of under 8 minutes,
#   0. print the toolchain (nvcc, gcc, ninja, torch, triton) and the card's state,
#   1. build the CUDA extension in place,
#   2. run the GPU tests (pytest -m gpu: tests/test_gpu_kernels.py holds issue 10's kernel
#      checks: graph capture/eviction/replay, deterministic norm, 32 KB tables, amsgrad,
#      one Triton variant per configuration),
#   3. run the benchmark suite at GPU sizes (accumulate and fused AdamW as % of a device-to-device
#      copy timed in the same run, cuda vs triton vs torch),
#   4. sweep the Triton launch shape (BLOCK x num_warps x programs per SM, benchmarks/triton_sweep.py)
#      and time the Triton launcher's host cost (benchmarks/triton_host.py, kernels stubbed),
#   5. the fused weight-gradient benchmark (benchmarks/wgrad.py --e2e, issue 13),
# and leave the log, the results and the plot under $OUT (default ./benchmarks/results).
#
# Usage, from anywhere:  bash benchmarks/device_check.sh
#   OUT=DIR        where the files go (the device tool sets it; it returns at most 8 files:
#                  this writes 8: device_check.log, kernels.csv, end_to_end.csv, results.json,
#                  kernels.png, triton_sweep.csv, triton_host.csv, wgrad.csv)
#   PYTHON=...     the interpreter (default python3: on the lent H200 that is the one with
#                  torch 2.11 cu130, triton 3.6, pytest and ninja; nothing can be installed there)
#   FUSED_ACCUM_GIT_COMMIT=<sha>  the commit to stamp on the results when .git did not travel
#
# Time: each step has its own limit so the whole stays under 8 minutes (480 s) even when a
# step hangs: build 120 s (16 cores) + tests 140 s (a bare machine JIT-compiles every Triton
# kernel specialisation the tests reach) + benchmarks 95 s (the suite stops starting new groups
# after 60 s, then measures the copy again and writes its files) + sweep 40 s (stops starting
# configs after 22 s; up to 12 compiles) + host 10 s + wgrad 60 s + ~10 s of probes = 475 s.
# A failed step does not stop the later ones: without the extension, the triton and reference
# backends are still benchmarked. Exit status: 0 only if every step passed.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-./benchmarks/results}"
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: > "$LOG"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1  # else python holds its output back and a killed step logs nothing
START=$SECONDS
status=0
summary=()

say() { echo "$*" | tee -a "$LOG"; }

run_step() {  # run_step NAME LIMIT_S CMD...: run with a time limit, log, record the outcome
    local name=$1 limit=$2
    shift 2
    say "=== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && say "=== $name: killed at its ${limit} s limit"
    say "=== $name: exit $rc after ${took} s"
    summary+=("$(printf '%-12s exit %3d  %4d s' "$name" "$rc" "$took")")
    [ "$rc" -eq 0 ] || status=1
}

if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
    say "device_check: no NVIDIA GPU here (nvidia-smi finds none); this script is for a lent GPU machine"
    exit 2
fi

if [ -z "${FUSED_ACCUM_GIT_COMMIT:-}" ] && commit=$(git rev-parse HEAD 2> /dev/null); then
    export FUSED_ACCUM_GIT_COMMIT="$commit"
fi

say "=== machine ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit ${FUSED_ACCUM_GIT_COMMIT:-unknown})"
# The toolchain first (issue 10 item 13): a failed build is read against these versions.
say "--- toolchain"
say "nvcc:   $( (command -v nvcc && nvcc --version | tail -n 2 | tr '\n' ' ') 2>&1 || echo 'not on PATH')"
say "CUDA_HOME=${CUDA_HOME:-unset}; /usr/local/cuda: $(ls -d /usr/local/cuda 2>/dev/null || echo absent)"
say "gcc:    $( (gcc --version | head -n 1) 2>&1 || echo 'not on PATH')"
say "ninja:  $( (ninja --version) 2>&1 || echo 'not on PATH')"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| torch cuda', torch.version.cuda, '| device', torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"
"$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a "$LOG"
# Read-only probes: the card's state is recorded, never changed (no clock or power settings).
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$LOG"

# 1. The extension, built for this GPU (the colleague's setup.py chooses the targets).
run_step build 120 env FUSED_ACCUM_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
"$PY" -c "from fused_accum import backends as b; print({n: b.availability(n, 'cuda') or 'available' for n in b.NAMES})" \
    2>&1 | tee -a "$LOG"

# 2. The GPU tests.
run_step gpu-tests 140 "$PY" -m pytest -m gpu tests -q --durations=15 -p no:cacheprovider

# 3. The benchmarks at GPU sizes, most useful groups first (see benchmarks/run.py).
run_step benchmarks 95 "$PY" benchmarks/run.py --out "$OUT" --time-budget 60

# 4. The Triton launch-shape sweep and the launcher's host time.
run_step triton-sweep 40 "$PY" benchmarks/triton_sweep.py --out "$OUT" --budget 22
run_step triton-host 10 "$PY" benchmarks/triton_host.py --out "$OUT" --repeat 50

# 5. The fused wgrad (F's, issue 13); its json stays behind (8 files come back at most).
WGRAD_TMP=$(mktemp -d)
run_step wgrad 60 "$PY" -m benchmarks.wgrad --device cuda --e2e --out "$WGRAD_TMP"
cp "$WGRAD_TMP"/wgrad.csv "$OUT"/ 2>/dev/null || say "(no wgrad.csv written)"

say "=== device_check summary"
for line in "${summary[@]}"; do say "    $line"; done
say "=== total $((SECONDS - START)) s; files in $OUT:"
ls -l "$OUT" 2>&1 | tee -a "$LOG"
exit $status

#!/usr/bin/env bash
# The one GPU check: on a machine with an NVIDIA GPU, in one call of under 8 minutes,
#   1. build the CUDA extension in place,
#   2. run the GPU tests (pytest -m gpu),
#   3. run the benchmark suite at GPU sizes,
# and leave the log, the results and the plot under $OUT (default ./benchmarks/results).
#
# Usage, from anywhere:  bash benchmarks/device_check.sh
#   OUT=DIR        where the files go (the device tool sets it; it returns at most 8 files:
#                  this writes 5: device_check.log, kernels.csv, end_to_end.csv, results.json,
#                  kernels.png)
#   PYTHON=...     the interpreter (default python3: on the lent H200 that is the one with
#                  torch 2.11 cu130, triton 3.6, pytest and ninja; nothing can be installed there)
#   FUSED_ACCUM_GIT_COMMIT=<sha>  the commit to stamp on the results when .git did not travel
#
# Time: each step has its own limit so the whole stays under 8 minutes (480 s) even when a
# step hangs: build 150 s + tests 170 s (a bare machine JIT-compiles every Triton kernel
# specialisation the tests reach) + benchmarks 130 s (the suite stops starting new groups after
# 90 s, then measures the copy again and writes its files) + ~10 s of probes = 460 s.
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
    summary+=("$(printf '%-11s exit %3d  %4d s' "$name" "$rc" "$took")")
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
# Read-only probes: the card's state is recorded, never changed (no clock or power settings).
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$LOG"
(nvcc --version | tail -n 2) 2>&1 | tee -a "$LOG"
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__, '| device', torch.cuda.get_device_name(0))" \
    2>&1 | tee -a "$LOG"

# 1. The extension, built for this GPU (the colleague's setup.py chooses the targets).
run_step build 150 env FUSED_ACCUM_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace
"$PY" -c "from fused_accum import backends as b; print({n: b.availability(n, 'cuda') or 'available' for n in b.NAMES})" \
    2>&1 | tee -a "$LOG"

# 2. The GPU tests.
run_step gpu-tests 170 "$PY" -m pytest -m gpu tests -q --durations=15

# 3. The benchmarks at GPU sizes, most useful groups first (see benchmarks/run.py).
run_step benchmarks 130 "$PY" benchmarks/run.py --out "$OUT" --time-budget 90

say "=== device_check summary"
for line in "${summary[@]}"; do say "    $line"; done
say "=== total $((SECONDS - START)) s; files in $OUT:"
ls -l "$OUT" 2>&1 | tee -a "$LOG"
exit $status

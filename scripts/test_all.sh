#!/usr/bin/env bash
# Every check that runs without a GPU, in order; the first failure stops the run.
# Called by `./run test` after set-up (so .venv exists and the package is installed).
#   bash scripts/test_all.sh               everything
#   bash scripts/test_all.sh --cpu-suite   the three pytest stages only (scripts/test_oldest_torch.sh
#                                          runs them on torch 2.11 with FUSED_ACCUM_TEST_PYTHON)
#   bash scripts/test_all.sh --quick       the loop for a change (./run test --quick): the formatter,
#                                          the tests not marked slow (tests/conftest.py: what starts
#                                          ranks or a subprocess of this Python), and the Triton
#                                          kernels' own tests under the interpreter
# Ends with one line: "fused_accum: all N stages passed in M min S s", or the stage that failed.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
PY=${FUSED_ACCUM_TEST_PYTHON:-.venv/bin/python}
# Each pytest stage on pytest-xdist: one worker per core, each taking the next test as it frees
# (the quick loop's 3.4 min on 2 quiet cores where one process takes 6.7). The tests that start
# ranks rendezvous through files under their own tmp_path, so workers never share a store.
WORKERS="-n auto --dist worksteal"

if [[ ${1:-} == --cpu-suite ]]; then
  TOTAL=3 NAME="fused_accum --cpu-suite ($PY)"
elif [[ ${1:-} == --quick ]]; then
  TOTAL=$((1 + $(grep -c '^  quick_stage "' "$SELF"))) NAME="fused_accum --quick" # (the formatter, then those)
else
  TOTAL=$(grep -c '^stage "\|^  stage "' "$SELF") NAME=fused_accum  # the stage lines below
fi
n=0 current="" start=$SECONDS
stage() { # stage "what it checks": numbers and announces the next stage
  n=$((n + 1)) current=$1
  echo "== $n/$TOTAL $1"
}
verdict() {
  local rc=$? took=$((SECONDS - start))
  took="$((took / 60)) min $((took % 60)) s"
  if [[ $rc -eq 0 ]]; then
    echo "$NAME: all $n stages passed in $took"
  elif [[ $rc -eq 130 || $rc -eq 143 ]]; then
    echo "$NAME: STOPPED by a signal at stage $n/$TOTAL ($current), after $took"
  else
    echo "$NAME: FAILED at stage $n/$TOTAL ($current), exit $rc, after $took"
  fi
}
quick_stage() { stage "$@"; } # (the quick loop's: not counted among the full run's stages)
trap verdict EXIT
trap 'exit 130' INT  # (a signal alone would leave the EXIT trap an exit status of 0)
trap 'exit 143' TERM

if [[ ${1:-} != --cpu-suite ]]; then
  stage "the formatter: ruff format --check (pyproject.toml [tool.ruff]; fix with: .venv/bin/ruff format .)"
  "$(dirname "$PY")/ruff" format --check --quiet .
fi

if [[ ${1:-} == --quick ]]; then
  quick_stage "pytest, not slow: every module's own tests on the C++ extension and the reference backend"
  "$PY" -m pytest -q tests --ignore=tests/integration -m "not gpu and not slow" $WORKERS
  # Its own process, as below: the backend's own tests and the matrix of every op against the
  # reference (the rest of the kernels', the optimizer's and the wgrad's Triton tests take the
  # interpreter 20 minutes here: the full run's).
  quick_stage "pytest, not slow: the Triton backend and its ops against the reference, under TRITON_INTERPRET=1"
  TRITON_INTERPRET=1 "$PY" -m pytest -q -m "not gpu and not slow" tests/test_triton_extra.py tests/test_kernels.py \
    -k "triton and (test_triton_extra or accumulate_matches_reference or step_matches_reference or split_step)"
  exit 0
fi

stage "pytest: reference, C++ CPU extension, optimizer, stacked path, demo, benchmarks"
"$PY" -m pytest -q tests --ignore=tests/integration $WORKERS

# The C++ hooks (fused_accum._C.Arrivals) ran above; their Python twin keeps the same contract.
stage "pytest: the drop-in contract again on the Python hooks (FUSED_ACCUM_PYTHON_HOOKS=1)"
FUSED_ACCUM_PYTHON_HOOKS=1 "$PY" -m pytest -q tests/test_dropin.py tests/test_hooks.py tests/test_offload.py $WORKERS

# Its own process: TRITON_INTERPRET must be set before triton is first imported.
stage "pytest: Triton kernels and the optimizer on backend=triton, under TRITON_INTERPRET=1"
TRITON_INTERPRET=1 "$PY" -m pytest -q tests/test_kernels.py tests/test_optimizer.py tests/test_triton_extra.py tests/test_nn.py \
  tests/test_torch_contract.py tests/test_muon.py -k triton $WORKERS
[[ ${1:-} == --cpu-suite ]] && exit 0

stage "C++ unit tests of the shared math and the kernels' plumbing (CMake + ctest)"
bash scripts/ctest.sh

stage "the CUDA extension compiles and links for sm_80 and sm_90 against both ends of the declared"
echo "   torch range (2.14.1 and 2.11.0, cu130), no spills"
bash scripts/check_cuda_build.sh 2.14.1 2.11.0

# The whole CPU suite on 2.11 would take CI from ~15 to near 30 minutes: here the slice where
# torch versions differ (the extension, the hooks, the optimizer contract); the whole of it is
# `bash scripts/test_oldest_torch.sh` (docs/tests.md).
stage "pytest on the oldest declared torch (2.11.0): the extension, hooks, ops, optimizer and drop-in tests"
bash scripts/test_oldest_torch.sh --ci

stage "install as a user, by the README's commands: pip install . stops with one line, so does a venv without"
echo "   torch (naming one to install); the wheel is fused_accum's alone and records its torch; another torch is said"
bash scripts/check_install.sh

# Its own process (the frameworks are heavy to import, and Accelerate keeps per-process state).
stage "pytest: HF Trainer, Accelerate and Lightning on fused_accum.AdamW against torch.optim.AdamW"
HF_HUB_OFFLINE=1 "$PY" -m pytest -q tests/integration

#!/usr/bin/env bash
# Every check that runs without a GPU, in order; the first failure stops the run.
# Called by `./run test` after set-up (so .venv exists and the package is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

echo "== pytest: reference, C++ CPU extension, optimizer, stacked path, demo, benchmarks"
"$PY" -m pytest -q tests --ignore=tests/integration

# The C++ hooks (fused_accum._C.Arrivals) ran above; their Python twin keeps the same contract.
echo "== pytest: the drop-in contract again on the Python hooks (FUSED_ACCUM_PYTHON_HOOKS=1)"
FUSED_ACCUM_PYTHON_HOOKS=1 "$PY" -m pytest -q tests/test_dropin.py tests/test_hooks.py

# Its own process: TRITON_INTERPRET must be set before triton is first imported.
echo "== pytest: Triton kernels and the optimizer on backend=triton, under TRITON_INTERPRET=1"
TRITON_INTERPRET=1 "$PY" -m pytest -q tests/test_kernels.py tests/test_optimizer.py tests/test_triton_extra.py tests/test_nn.py -k triton

echo "== C++ unit tests of the shared math and the kernels' plumbing (CMake + ctest)"
bash scripts/ctest.sh

echo "== the CUDA extension compiles and links for sm_80 and sm_90 (torch 2.14.1 cu130), no spills"
bash scripts/check_cuda_build.sh

# Its own process (the frameworks are heavy to import, and Accelerate keeps per-process state).
echo "== pytest: HF Trainer, Accelerate and Lightning on fused_accum.AdamW against torch.optim.AdamW"
HF_HUB_OFFLINE=1 "$PY" -m pytest -q tests/integration

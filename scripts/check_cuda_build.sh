#!/usr/bin/env bash
# CI's only check of the GPU side without a GPU: compile the Triton kernels for sm_90 and fail on
# any spill (scripts/check_triton_spills.py), then compile and link fused_accum._C with its CUDA
# kernels against torch==2.14.1 (cu130), load it, and fail on any register spill.
#
# The torch used is a CUDA build in its own venv, cached outside the clone (5.4 GB, ~80 s to
# install from the local wheel files the first time; reused after). The extension is built into
# build/cuda-check/, never in place, so the CPU build in .venv is left alone. Objects are kept in
# build/ext-torch2.14.1+cu130-cuda/, so a second run only re-links what changed (seconds).
# Exits 0 with a message when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN=torch==2.14.1
VENV=${FUSED_ACCUM_CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fused_accum/venv-torch2.14.1-cu130}
OUT=build/cuda-check
LOG=$OUT/build.log

# The Triton kernels' spill gate first: it needs only triton (its own ptxas and cuobjdump), not
# nvcc or a GPU (issue 10 item 11). Triton caches the compiled variants, so a rerun is seconds.
TRITON_PY=${FUSED_ACCUM_PYTHON:-.venv/bin/python}
[[ -x $TRITON_PY ]] || TRITON_PY=python3
if env -u TRITON_INTERPRET "$TRITON_PY" -c "import triton" 2>/dev/null; then
  if ! env -u TRITON_INTERPRET "$TRITON_PY" scripts/check_triton_spills.py; then
    echo "[check_cuda_build] FAIL: a Triton kernel spills (see above)"
    exit 1
  fi
else
  echo "[check_cuda_build] SKIP the Triton spill gate: $TRITON_PY cannot import triton"
fi

if ! command -v nvcc >/dev/null && [[ -z "${CUDA_HOME:-}" ]]; then
  echo "[check_cuda_build] SKIP: nvcc is not on PATH and CUDA_HOME is not set, so the CUDA kernels cannot be compiled here"
  exit 0
fi

if ! "$VENV/bin/python" -c "import torch, ninja, setuptools; assert torch.__version__.startswith('2.14.1+cu13')" 2>/dev/null; then
  echo "[check_cuda_build] creating $VENV with $TORCH_PIN (CUDA 13.0 build; ~80 s, 5.4 GB)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN" ninja setuptools wheel
fi
"$VENV/bin/python" -W ignore -c "import torch; print('[check_cuda_build] torch', torch.__version__, 'CUDA', torch.version.cuda)" 2>/dev/null

mkdir -p "$OUT/ptxas"
# ptxas reports come from compiling: a kernel file whose report is missing is compiled again.
for cu in csrc/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  [[ -s "$OUT/ptxas/$name.txt" ]] || rm -f build/ext-*-cuda/csrc/cuda/"$name".o
done
start=$SECONDS
if ! FUSED_ACCUM_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py -q build_ext \
    --build-lib "$OUT/lib" >"$LOG" 2>&1; then
  tail -n 60 "$LOG"
  echo "[check_cuda_build] FAIL: the CUDA extension did not build (full log: $LOG)"
  exit 1
fi
echo "[check_cuda_build] built in $((SECONDS - start)) s (log: $LOG)"

# ptxas -v prints one "N bytes spill stores, M bytes spill loads" line per kernel and target.
# The log holds it only for objects compiled in this run: keep the last report of each .cu.
for cu in csrc/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  if grep -q "ptxas info" "$LOG" && grep -q "$name" "$LOG"; then
    awk -v f="$name" '/\[[0-9]+\/[0-9]+\]/ {cur = index($0, "/" f ".cu") ? 1 : 0} cur && !/^\[/ && /ptxas|spill|Used/' "$LOG" >"$OUT/ptxas/$name.txt.new"
    [[ -s "$OUT/ptxas/$name.txt.new" ]] && mv "$OUT/ptxas/$name.txt.new" "$OUT/ptxas/$name.txt"
    rm -f "$OUT/ptxas/$name.txt.new"
  fi
done
reports=$(cat "$OUT"/ptxas/*.txt 2>/dev/null || true)
kernels=$(grep -c "Compiling entry function" <<<"$reports" || true)
spills=$(grep -E "spill (stores|loads)" <<<"$reports" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)
stack=$(grep -E "bytes stack frame" <<<"$reports" | grep -vc "^ *0 bytes stack frame" || true)
echo "[check_cuda_build] ptxas: $kernels kernel compilations (sm_80 + sm_90), $spills with spills, $stack with a stack frame"
grep -E "Used [0-9]+ registers" <<<"$reports" | sed 's/^/    /' | sort | uniq -c | head -20
if [[ "$kernels" -eq 0 ]]; then
  echo "[check_cuda_build] FAIL: no ptxas report found in $OUT/ptxas (was -Xptxas -v dropped?)"
  exit 1
fi
if [[ "$spills" -ne 0 ]]; then
  grep -B2 -E "spill" <<<"$reports" | grep -v " 0 bytes spill stores, 0 bytes spill loads" || true
  echo "[check_cuda_build] FAIL: register spills (local memory in a bandwidth-bound kernel)"
  exit 1
fi

# Load it as a user would: the ops must be registered for CPU and CUDA (no GPU needed for that).
"$VENV/bin/python" -W ignore - "$OUT/lib" <<'PY'
import sys, importlib.util, glob, torch
so = glob.glob(f"{sys.argv[1]}/fused_accum/_C*.so")[0]
spec = importlib.util.spec_from_file_location("fused_accum._C", so)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
assert mod.built_with_cuda == 1, "built without CUDA kernels"
for op in ("accumulate_", "sgd_step_", "adam_step_", "lion_step_"):
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fused_accum_ext::{op}", key), (op, key)
print(f"[check_cuda_build] OK: {so} loads, 4 ops x (CPU, CUDA) registered")
PY

#!/usr/bin/env bash
# CI's check of the GPU side without a GPU: compile the Triton kernels for sm_90 and fail on any
# spill (scripts/check_triton_spills.py), then compile and link fused_accum._C with its CUDA
# kernels against both ends of the declared torch range, load it, and fail on any register spill.
#
#   bash scripts/check_cuda_build.sh [VERSION ...]     default: 2.14.1 2.11.0
#
# torch 2.14.1 (cu130, the newest declared): a full CUDA build of torch in its own venv, from
# this machine's local wheel files (5.4 GB, ~80 s the first time; reused after).
# torch 2.11.0 (cu130, the oldest declared: the lent H200's): downloaded (531 MB) and installed
# without its CUDA packages, whose headers and libraries it borrows from the 2.14.1 venv (both
# CUDA 13.0): see scripts/torch_venvs.sh. Both venvs and the download live in
# ~/.cache/fused_accum, outside the clone. The extension is built into
# build/cuda-check-<version>/, never in place, so the CPU build in .venv is left alone. Objects
# are kept in build/ext-torch<version>+cu130-cuda/, so a second run only re-links what changed.
# Exits 0 with a message when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS=("$@")
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=(2.14.1 2.11.0)
source scripts/torch_venvs.sh  # venv_of, ensure_torch

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

check_version() {  # check_version VERSION: build, spill report, load
  local version=$1 venv out log start
  venv=$(venv_of "$version")
  out=build/cuda-check-$version
  log=$out/build.log
  ensure_torch "$version"
  "$venv/bin/python" -W ignore -c "import torch; print('[check_cuda_build] torch', torch.__version__, 'CUDA', torch.version.cuda)"

  mkdir -p "$out/ptxas"
  # ptxas reports come from compiling: a kernel file whose report is missing is compiled again.
  for cu in csrc/cuda/*.cu; do
    name=$(basename "$cu" .cu)
    [[ -s "$out/ptxas/$name.txt" ]] || rm -f build/ext-torch"$version"+cu130-cuda/csrc/cuda/"$name".o
  done
  start=$SECONDS
  if ! FUSED_ACCUM_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/python" setup.py -q build_ext \
      --build-lib "$out/lib" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "[check_cuda_build] FAIL: the CUDA extension did not build against torch $version (full log: $log)"
    exit 1
  fi
  echo "[check_cuda_build] built against torch $version in $((SECONDS - start)) s (log: $log)"

  # ptxas -v prints one "N bytes spill stores, M bytes spill loads" line per kernel and target.
  # The log holds it only for objects compiled in this run: keep the last report of each .cu.
  for cu in csrc/cuda/*.cu; do
    name=$(basename "$cu" .cu)
    if grep -q "ptxas info" "$log" && grep -q "$name" "$log"; then
      awk -v f="$name" '/\[[0-9]+\/[0-9]+\]/ {cur = index($0, "/" f ".cu") ? 1 : 0} cur && !/^\[/ && /ptxas|spill|Used/' "$log" >"$out/ptxas/$name.txt.new"
      [[ -s "$out/ptxas/$name.txt.new" ]] && mv "$out/ptxas/$name.txt.new" "$out/ptxas/$name.txt"
      rm -f "$out/ptxas/$name.txt.new"
    fi
  done
  local reports kernels spills stack
  reports=$(cat "$out"/ptxas/*.txt 2>/dev/null || true)
  kernels=$(grep -c "Compiling entry function" <<<"$reports" || true)
  spills=$(grep -E "spill (stores|loads)" <<<"$reports" | grep -vc " 0 bytes spill stores, 0 bytes spill loads" || true)
  stack=$(grep -E "bytes stack frame" <<<"$reports" | grep -vc "^ *0 bytes stack frame" || true)
  echo "[check_cuda_build] ptxas: $kernels kernel compilations (sm_80 + sm_90), $spills with spills, $stack with a stack frame"
  grep -E "Used [0-9]+ registers" <<<"$reports" | sed 's/^/    /' | sort | uniq -c | head -20
  if [[ "$kernels" -eq 0 ]]; then
    echo "[check_cuda_build] FAIL: no ptxas report found in $out/ptxas (was -Xptxas -v dropped?)"
    exit 1
  fi
  if [[ "$spills" -ne 0 ]]; then
    grep -B2 -E "spill" <<<"$reports" | grep -v " 0 bytes spill stores, 0 bytes spill loads" || true
    echo "[check_cuda_build] FAIL: register spills (local memory in a bandwidth-bound kernel)"
    exit 1
  fi

  # Load it as a user would: the ops must be registered for CPU and CUDA (no GPU needed for that),
  # and the build must have recorded the torch it was built against (fused_accum/backends/ext.py).
  "$venv/bin/python" -W ignore - "$out/lib" "$version" csrc/math.h <<'PY'
import glob, importlib.util, json, os, re, sys
import torch
so = glob.glob(f"{sys.argv[1]}/fused_accum/_C*.so")[0]
record = json.load(open(os.path.join(os.path.dirname(so), "_C.build.json")))
assert record["torch"] == torch.__version__ == sys.argv[2] + "+cu130" and record["cuda_kernels"], record
spec = importlib.util.spec_from_file_location("fused_accum._C", so)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
assert mod.built_with_cuda == 1, "built without CUDA kernels"
# every operator _C registers for the CPU (a step op per algorithm of csrc/math.h: each trait's
# kOp), for CUDA too
ops = sorted(op for op in torch._C._dispatch_get_registrations_for_dispatch_key("CPU") if op.startswith("fused_accum_ext::"))
traits = re.findall(r'kOp = "(\w+)"', open(sys.argv[3]).read())
assert {f"fused_accum_ext::{name}" for name in ("accumulate_", "fold_pieces_", *traits)} == set(ops), (traits, ops)
for op in ops:
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), (op, "CUDA")
print(f"[check_cuda_build] OK: {so} loads in torch {torch.__version__}, {len(ops)} ops x (CPU, CUDA) registered "
      f"({', '.join(op.split('::')[1] for op in ops)}), built-against record {record['torch']}")
PY
}

for version in "${VERSIONS[@]}"; do
  check_version "$version"
done

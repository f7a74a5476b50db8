#!/usr/bin/env bash
# The CPU suite on the oldest declared torch, 2.11.0 (the lent H200's), in its cached venv:
#
#   bash scripts/test_oldest_torch.sh          the whole CPU suite, as scripts/test_all.sh runs it
#                                              on .venv: pytest, the drop-in tests on the Python
#                                              hooks, the Triton interpreter stage (about as long
#                                              as those stages of ./run test)
#   bash scripts/test_oldest_torch.sh --ci     CI's slice (~1 minute): the version-sensitive parts,
#                                              the extension, the hooks and the optimizer contract
#
# Not all of it in CI: the whole suite again would take CI from ~15 minutes to near 30.
# The tests run on a copy of the tree (tracked and untracked-not-ignored files) in
# build/oldest-torch/src, with the fused_accum._C that scripts/check_cuda_build.sh built against
# torch 2.11.0 (the CUDA-enabled one the GPU machine builds, loaded here without a GPU); without
# nvcc, a CPU-only _C built in the copy. The venv (scripts/torch_venvs.sh) gets the test
# dependencies and triton 3.6.0, the GPU machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=2.11.0
TRITON_PIN=triton==3.6.0
# triton 3.6's interpreter turns one-element arrays into Python ints (range() over a tensor bound),
# which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"): every
# Triton test of the interpreter stage fails with numpy 2.4, none with 2.3.
NUMPY_PIN="numpy<2.4"
source scripts/torch_venvs.sh
start=$SECONDS

ensure_torch $VERSION
PY=$(venv_of $VERSION)/bin/python
XDIST_PIN=$(grep -o '^pytest-xdist==[0-9.]*' requirements-dev.txt)
"$PY" -c "import pytest, xdist, hypothesis, numpy, triton; assert triton.__version__ == '${TRITON_PIN#triton==}'
assert tuple(map(int, numpy.__version__.split('.')[:2])) < (2, 4)" 2>/dev/null \
  || quiet_pip "$PY" -m pip install -q --no-warn-conflicts "pytest>=8" "$NUMPY_PIN" tqdm matplotlib "hypothesis>=6.100" \
    "$TRITON_PIN" "$XDIST_PIN"
# AdEMAMix's peer (tests/cases.py), pinned in requirements-dev.txt; without its dependencies, so
# that pip cannot swap this venv's torch for another
PEER_PIN=$(grep -o '^pytorch-optimizer==[0-9.]*' requirements-dev.txt)
"$PY" -c "import pytorch_optimizer" 2>/dev/null || quiet_pip "$PY" -m pip install -q --no-deps "$PEER_PIN"

# The extension against torch 2.11 (a no-op re-link when nothing changed), then the tree's copy.
bash scripts/check_cuda_build.sh $VERSION >build/oldest-torch.build.log 2>&1 || {
  cat build/oldest-torch.build.log; echo "[test_oldest_torch] FAIL: the extension did not build against torch $VERSION"; exit 1; }
SRC=build/oldest-torch/src
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SRC"
built=(build/cuda-check-$VERSION/lib/fused_accum/_C*.so)
if [[ -e ${built[0]} ]]; then
  cp "${built[0]}" build/cuda-check-$VERSION/lib/fused_accum/_C.build.json "$SRC/fused_accum/"
else  # no nvcc here: the CPU kernels only, built in the copy (its build/ is kept between runs)
  (cd "$SRC" && FUSED_ACCUM_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --inplace \
     >"$ROOT/build/oldest-torch.build.log" 2>&1) || {
    cat build/oldest-torch.build.log; echo "[test_oldest_torch] FAIL: the CPU extension did not build"; exit 1; }
fi
cd "$SRC"  # the copy's fused_accum (and its _C) is what python finds first
"$PY" -W ignore -c "import torch, triton; from fused_accum.backends import ext
assert ext._C is not None, ext.unavailable_reason('cpu')
print('[test_oldest_torch] torch', torch.__version__, '| triton', triton.__version__, '| fused_accum._C from', ext._C.__file__)"

if [[ ${1:-} == --ci ]]; then
  echo "== pytest on torch $VERSION: the extension, the hooks, the ops, the optimizer and drop-in contracts"
  "$PY" -m pytest -q -p no:cacheprovider tests/test_ext.py tests/test_hooks.py tests/test_ops.py \
    tests/test_optimizer.py tests/test_dropin.py -n auto --dist worksteal
else  # the pytest stages of ./run test, on this torch (the copy's scripts/test_all.sh)
  FUSED_ACCUM_TEST_PYTHON=$PY bash scripts/test_all.sh --cpu-suite
fi
echo "[test_oldest_torch] OK on torch $VERSION in $((SECONDS - start)) s"

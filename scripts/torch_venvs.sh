# Sourced by scripts/check_cuda_build.sh and scripts/test_oldest_torch.sh: CUDA builds of torch
# (cu130) in venvs of their own, cached outside the clone in ~/.cache/fused_accum
# (FUSED_ACCUM_CACHE), so reruns and fresh clones on one machine reuse them.
#   ensure_torch VERSION   makes $(venv_of VERSION) unless it is already there
# torch $NEWEST (the newest declared) is installed whole from this machine's local wheel files
# (5.4 GB, ~80 s the first time). Any other version is a "thin" venv: its wheel is not among the
# local files, so `pip download --no-deps` fetches it (2.11.0: 531 MB, kept in the cache) and it
# is installed without its CUDA dependencies (several GB more). Every declared version is a CUDA
# 13.0 build, so a thin venv takes the CUDA headers and libraries (nvidia/cu13, cudnn, nccl, ...)
# of the $NEWEST venv through a symlink: enough to compile and link against it and import it
# (no GPU is used).
NEWEST=2.14.1
CACHE=${FUSED_ACCUM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fused_accum}
PY_TAG=cp$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')

venv_of() { echo "$CACHE/venv-torch$1-cu130"; }
site_of() { "$(venv_of "$1")/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }

quiet_pip() {  # a pip command, its notes about this machine's package mirrors dropped
  local rc=0
  mkdir -p "$CACHE"
  "$@" >"$CACHE/pip.log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$CACHE/pip.log" || true
  return $rc
}

has_torch() {
  "$(venv_of "$1")/bin/python" -W ignore -c "import torch, ninja, setuptools; assert torch.__version__ == '$1+cu130'" 2>/dev/null
}

ensure_newest() {
  local venv
  venv=$(venv_of $NEWEST)
  has_torch $NEWEST && return 0
  echo "[torch_venvs] creating $venv with torch==$NEWEST (CUDA 13.0 build; ~80 s, 5.4 GB)"
  rm -rf "$venv"
  mkdir -p "$CACHE"
  python3 -m venv "$venv"
  quiet_pip "$venv/bin/python" -m pip install -q "torch==$NEWEST" ninja setuptools wheel
}

ensure_thin() {
  local version=$1 venv wheel
  venv=$(venv_of "$version")
  has_torch "$version" && return 0
  ensure_newest
  mkdir -p "$CACHE/wheels"
  wheel=$(ls "$CACHE"/wheels/torch-"$version"-"$PY_TAG"-*manylinux*_x86_64.whl 2>/dev/null | head -n 1 || true)
  if [[ -z $wheel ]]; then
    echo "[torch_venvs] downloading torch==$version (cu130, ~531 MB for 2.11.0; kept in $CACHE/wheels)"
    if ! quiet_pip python3 -m pip download -q --no-deps --only-binary=:all: -d "$CACHE/wheels" "torch==$version"; then
      echo "[torch_venvs] FAIL: could not download torch==$version (no network?)"
      return 1
    fi
    wheel=$(ls "$CACHE"/wheels/torch-"$version"-"$PY_TAG"-*manylinux*_x86_64.whl | head -n 1)
  fi
  echo "[torch_venvs] creating $venv from $(basename "$wheel"), its CUDA libraries borrowed from torch $NEWEST's venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  quiet_pip "$venv/bin/python" -m pip install -q --no-deps --no-warn-conflicts "$wheel"
  # its pure-Python requirements (torch 2.11 asks for setuptools < 82), and the build's tools
  quiet_pip "$venv/bin/python" -m pip install -q --no-warn-conflicts filelock "typing-extensions>=4.10" \
    "sympy>=1.13.3" "networkx>=2.5.1" jinja2 "fsspec>=0.8.5" "setuptools>=64,<82" ninja wheel
  ln -sfn "$(site_of $NEWEST)/nvidia" "$(site_of "$version")/nvidia"
}

ensure_torch() {
  if [[ $1 == "$NEWEST" ]]; then ensure_newest; else ensure_thin "$1"; fi
}

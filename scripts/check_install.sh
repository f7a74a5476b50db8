#!/usr/bin/env bash
# fused_accum installed as a new user installs it, by the commands README.md prints ("Installing it
# elsewhere"), read from the README and run as written, from a fresh venv that holds only torch:
#   1. `pip install .` (pip's default build isolation: the build cannot import torch) fails with
#      setup.py's one line saying what to type, not a traceback ending in ModuleNotFoundError;
#      and in a venv without torch, the README's `pip install --no-build-isolation .` fails with
#      two lines naming the README's own torch command and the supported range;
#   2. the README's `pip wheel --no-build-isolation --no-deps .` builds one wheel, fused_accum's
#      alone (without --no-deps pip also fetches torch 2.14.1's CUDA build: 2.9 GB), holding
#      fused_accum/_C*.so and fused_accum/_C.build.json, which names the torch it was built against;
#   3. the README's `pip install --no-build-isolation .` leaves torch as it was and adds fused_accum
#      alone; imported away from the source tree, it loads _C with no warning and an AdamW step on
#      the cpu backend equals the reference backend's;
#   4. the same install with a record that names another torch: exactly one RuntimeWarning,
#      naming both versions and the rebuild command; _C is not loaded, and the package still
#      steps on the reference backend;
#   5. where scripts/check_cuda_build.sh left its torch 2.11 venv: the wheel built against
#      2.13 imported next to torch 2.11 (a real difference) gives the same one warning.
# The README's torch command itself is not run (its index is not reachable from every machine):
# the venv gets the same torch==2.13.0 from the configured index.
# Called by scripts/test_all.sh. The venv holds torch==2.13.0 (from the local CPU wheel, ~25 s;
# never an unpinned torch, which would be a CUDA build of several GB), ninja, tqdm (fused_accum's
# other dependency) and torch's own requirements, nothing else: it is kept in
# ~/.cache/fused_accum/install-check between runs, with fused_accum uninstalled first and remade
# whenever it holds anything more. (Remade every run, its torch headers would be new each time,
# and the wheel's ~60 s compile with them.) The wheel is built from a copy of the tree beside it,
# at a fixed path, whose ninja objects are kept: a rerun recompiles only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${FUSED_ACCUM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fused_accum}
WORK=$CACHE/install-check
VENV=$WORK/venv
NO_TORCH_VENV=$WORK/venv-without-torch
SRC=$WORK/src
TORCH_PIN=torch==2.13.0
TORCH211_VENV=${FUSED_ACCUM_TORCH211_VENV:-$CACHE/venv-torch2.11.0-cu130}
# what a venv with only torch 2.13.0, ninja and tqdm holds (pip freeze names, lower case)
ONLY_TORCH="filelock fsspec jinja2 markupsafe mpmath networkx ninja setuptools sympy torch tqdm typing_extensions"
start=$SECONDS
export PYTHONWARNINGS="ignore:Failed to initialize NumPy:UserWarning"  # torch without numpy: noise here

fail() { echo "[check_install] FAIL: $*"; exit 1; }
# pip's notes about this machine's package mirrors are noise here
pip_quiet() { "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

installed() {  # installed VENV: its packages' names, lower case, on one line
  "$1/bin/python" -m pip list --format=freeze 2>/dev/null | grep -v "^pip==" | cut -d= -f1 \
    | tr 'A-Z-' 'a-z_' | sort | tr '\n' ' '
}
holds_only_torch() {
  [[ -x $VENV/bin/python ]] || return 1
  "$VENV/bin/python" -m pip uninstall -q -y fused_accum >/dev/null 2>&1 || true
  [[ "$(installed "$VENV")" == "$ONLY_TORCH " ]] \
    && "$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu'" 2>/dev/null
}
# A command of the README's install paragraph, as printed there (its comment dropped): the
# first README line that starts with $1.
readme_command() {
  local line
  line=$(grep -m 1 -E "^$1" "$ROOT/README.md") \
    || { echo "[check_install] FAIL: README.md prints no command starting with '$1'" >&2; return 1; }
  sed -E 's/[[:space:]]+#.*$//; s/[[:space:]]+$//' <<<"$line"
}
README_TORCH=$(readme_command "pip install torch==") || exit 1
README_INSTALL=$(readme_command "pip install --no-build-isolation ") || exit 1
README_WHEEL=$(readme_command "pip wheel ") || exit 1
# as_user VENV COMMAND: the README's words, run as written in the copy of the tree with the venv's
# pip first on PATH; prints what it printed (less the mirror notes), returns its exit status
as_user() {
  local rc=0
  (PATH=$1/bin:$PATH && cd "$SRC" && bash -c "$2") >"$WORK/as_user.log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$WORK/as_user.log" || true
  return $rc
}
words() { tr ' ' '\n' <<<"$*" | grep -v '^$' | sort | tr '\n' ' '; }  # as `installed` lists them
mkdir -p "$WORK"
if ! holds_only_torch; then
  echo "[check_install] making $VENV: torch 2.13.0 (CPU), ninja and tqdm, nothing else"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  pip_quiet install -q "$TORCH_PIN" ninja tqdm
  holds_only_torch || fail "the venv holds more than torch, ninja and tqdm: $(installed "$VENV")"
fi

# A copy of the tree as a clone would have it (tracked and untracked-but-not-ignored files), its
# build/ kept between runs; tar keeps the files' times, so ninja sees unchanged sources as such.
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
rm -rf "$SRC"/build/lib*  # (the Python files of the last build: a module since removed would ship)
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$SRC"
cd "$SRC"

# 1. pip install . without the flag (the README: "a plain `pip install .` stops with one line")
rc=0 && out=$(as_user "$VENV" "pip install .") || rc=$?
[[ $rc -ne 0 ]] || fail "pip install . (isolated) succeeded: it cannot have built the extension against torch"
if grep -qE "Traceback|ModuleNotFoundError" <<<"$out" || ! grep -q "\[1 lines of output\]" <<<"$out" \
    || ! grep -q 'run `pip install --no-build-isolation .`' <<<"$out"; then
  echo "$out"
  fail "pip install . must end in setup.py's one line saying what to type (above: what it printed)"
fi
echo "[check_install] 1. pip install . (isolated) stops with one line: $(grep -o 'fused_accum builds.*' <<<"$out" | head -n 1)"

# ... and the README's install command where no torch is installed: two lines, which torch to get
if [[ ! -x $NO_TORCH_VENV/bin/python ]] || "$NO_TORCH_VENV/bin/python" -c "import torch" 2>/dev/null; then
  rm -rf "$NO_TORCH_VENV"
  python3 -m venv "$NO_TORCH_VENV"
fi
rc=0 && out=$(as_user "$NO_TORCH_VENV" "$README_INSTALL") || rc=$?
spec=$(grep -oE '"torch[<>=~!][^"]*"' "$ROOT/pyproject.toml" | head -n 1 | tr -d '"')
if [[ $rc -eq 0 ]] || grep -qE "Traceback|ModuleNotFoundError" <<<"$out" \
    || ! grep -q "\[2 lines of output\]" <<<"$out" || ! grep -q "has no torch" <<<"$out" \
    || ! grep -qF "\`$README_TORCH\`" <<<"$out" || ! grep -qF "any $spec works" <<<"$out" \
    || ! grep -qF "then \`$README_INSTALL\`" <<<"$out"; then
  echo "$out"
  fail "without torch, '$README_INSTALL' must say in two lines that torch is missing, the README's '$README_TORCH' and $spec (above: what it printed)"
fi
echo "[check_install] 1b. without torch, '$README_INSTALL' stops with two lines:"
grep -A 1 "has no torch" <<<"$out" | sed 's/^ */    /'

# 2. the README's wheel command, as written: fused_accum's wheel alone (a dependency fetched
# would be torch 2.14.1's CUDA build and 20 nvidia/triton wheels: 2.9 GB)
rm -f "$SRC"/*.whl
as_user "$VENV" "$README_WHEEL" >"$WORK/wheel.log" || { cat "$WORK/wheel.log"; fail "'$README_WHEEL' failed (above)"; }
wheels=$(cd "$SRC" && ls ./*.whl 2>/dev/null | tr '\n' ' ')
[[ $wheels == "./fused_accum-"*".whl " ]] \
  || { cat "$WORK/wheel.log"; fail "'$README_WHEEL' must build fused_accum's wheel alone; it left: ${wheels:-no wheel}"; }
rm -rf "$WORK/dist" && mkdir -p "$WORK/dist" && mv "$SRC"/fused_accum-*.whl "$WORK/dist/"
wheel=$(ls "$WORK"/dist/fused_accum-*.whl)
"$VENV/bin/python" - "$wheel" "$README_WHEEL" <<'PY' || fail "the wheel lacks the extension or its record (above)"
import json, sys, zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith("fused_accum/_C") and n.endswith(".so") for n in names), names
record = json.loads(zipfile.ZipFile(sys.argv[1]).read("fused_accum/_C.build.json"))
print(f"[check_install] 2. '{sys.argv[2]}': one wheel, with _C, built against torch {record['torch']}")
PY

# 3. the README's install command, as written: torch stays, fused_accum alone is added
as_user "$VENV" "$README_INSTALL" >"$WORK/install.log" || { cat "$WORK/install.log"; fail "'$README_INSTALL' failed (above)"; }
[[ "$(installed "$VENV")" == "$(words "$ONLY_TORCH" fused_accum)" ]] \
  || { cat "$WORK/install.log"; fail "'$README_INSTALL' must add fused_accum alone; the venv holds: $(installed "$VENV")"; }
cd "$WORK"  # from here on nothing may import fused_accum from the source tree

# its _C loads, no warning, and steps as the reference does
"$VENV/bin/python" - "$wheel" <<'PY' || fail "the installed package does not load or run its extension (above)"
import json, sys, warnings, zipfile

record = json.loads(zipfile.ZipFile(sys.argv[1]).read("fused_accum/_C.build.json"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import fused_accum
    from fused_accum.backends import ext
assert not [w for w in caught if "fused_accum" in str(w.message)], [str(w.message) for w in caught]

assert "site-packages" in fused_accum.__file__, fused_accum.__file__
assert record["torch"] == torch.__version__ == "2.13.0+cpu", (record, torch.__version__)
assert ext._C is not None, ext.unavailable_reason("cpu")


def steps(backend):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = fused_accum.AdamW([p], lr=1e-2, accum_steps=2, backend=backend)
    for i in range(4):
        ((p * (i + 1)) ** 2).sum().backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    return p.detach()


# the same fp32 math in the same order (csrc/math.h is the reference's update rule): 1e-6
# relative allows a differently rounded power of the betas and nothing more
torch.testing.assert_close(steps("cpu"), steps("reference"), rtol=1e-6, atol=1e-7)
print(f"[check_install] 3. installed (torch {torch.__version__} kept, fused_accum alone added), _C loads, "
      "an AdamW window on the cpu backend equals the reference's")
PY

# 4. a record naming another torch, in the installed copy
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp "$site/fused_accum/_C.build.json" "$WORK/record.json"
"$VENV/bin/python" - "$site/fused_accum/_C.build.json" <<'PY'
import json, sys
record = json.load(open(sys.argv[1]))
record["torch"] = "2.12.0+cpu"
json.dump(record, open(sys.argv[1], "w"))
PY
MISMATCH_CHECK=$(cat <<'PY'
import sys, warnings

built = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch
    import fused_accum
    from fused_accum.backends import ext
ours = [w for w in caught if "fused_accum._C" in str(w.message)]
assert len(ours) == 1, [str(w.message) for w in caught]
message = str(ours[0].message)
assert ours[0].category is RuntimeWarning
for needed in (built, torch.__version__, "pip install --no-build-isolation"):
    assert needed in message, (needed, message)
assert ext._C is None and ext.unavailable_reason("cpu") == message
p = torch.nn.Parameter(torch.randn(100))
opt = fused_accum.AdamW([p], lr=1e-2, backend="auto")
before = p.detach().clone()
(p ** 2).sum().backward()
opt.step()
assert not torch.equal(p.detach(), before)
print(f"[check_install] torch {torch.__version__} with an extension built against {built}: one warning, "
      f"_C not loaded, steps on the reference backend:\n    {message}")
PY
)
"$VENV/bin/python" -c "$MISMATCH_CHECK" 2.12.0+cpu || fail "a recorded torch that differs is not said clearly (above)"
cp "$WORK/record.json" "$site/fused_accum/_C.build.json"

# 5. the same wheel next to a real torch 2.11 (its CUDA build; no GPU needed to import it)
if [[ -x $TORCH211_VENV/bin/python ]]; then
  rm -rf "$WORK/t211"
  pip_quiet install -q --no-deps --target "$WORK/t211" "$wheel"  # beside, not into, the 2.11 venv
  built=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
  PYTHONPATH=$WORK/t211 "$TORCH211_VENV/bin/python" -c "$MISMATCH_CHECK" "$built" \
    || fail "the wheel built against torch $built is not refused clearly next to torch 2.11 (above)"
else
  echo "[check_install] 5. skipped: no torch 2.11 venv at $TORCH211_VENV (scripts/check_cuda_build.sh makes it)"
fi
echo "[check_install] OK in $((SECONDS - start)) s"

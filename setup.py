"""Installs fused_accum and builds its C++/CUDA extension, fused_accum._C.

`pip install --no-build-isolation .` (or `--no-deps -e .`, what ./run does; for a wheel
`pip wheel --no-build-isolation --no-deps .`) builds the extension against the torch already
installed; a plain `pip install .` builds in an isolated environment without torch and stops with
one line saying so, and where no torch is installed at all, two lines say which to install. Next
to the extension the build writes fused_accum/_C.build.json, the torch it was built against,
which fused_accum.extension reads before loading the extension (a C++ ABI mismatch otherwise
shows up as an undefined symbol, or worse). The CPU kernels are always built; the CUDA kernels
are built when both nvcc and a CUDA build of torch are present. That is decided from the toolkit and
torch.version.cuda, never from torch.cuda.is_available(): CI compiles the CUDA kernels on machines
without a GPU.

Environment:
  FUSED_ACCUM_NO_EXT=1        build no extension; the package then runs on the reference/Triton
                              backends and logs once why fused_accum._C is missing
  FUSED_ACCUM_BUILD_CUDA=1    build the CUDA kernels, or fail saying why they cannot be built
  FUSED_ACCUM_BUILD_CUDA=0    never build them
  CUDA_HOME / CUDA_PATH       the CUDA toolkit (default: found from the nvcc on PATH, else
                              /usr/local/cuda, as torch.utils.cpp_extension looks)
  MAX_JOBS                    parallel compile jobs (default: one per core, at most 8)
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA_ARCHS = ("80", "90")
DEFAULT_CUDA_HOME = (
    "/usr/local/cuda"  # torch's last guess too  # A100 and H100/H200 machine code; compute_90 PTX for newer GPUs
)


# pip builds in an isolated environment by default, which has no torch (pyproject.toml cannot ask
# for one: pip would download a CUDA build of several GB, and the extension must match the torch
# the user runs anyway). Said in one line, as flash-attn and apex do, instead of a traceback; and
# where there is no torch at all, build isolation or not, two lines saying which torch to install.
ISOLATED = (
    "fused_accum builds its C++ extension against the torch you have installed, which pip's build "
    "isolation hides: run `pip install --no-build-isolation .` (the same flag for git+URL installs; "
    "for a wheel `pip wheel --no-build-isolation --no-deps .`; FUSED_ACCUM_NO_EXT=1 builds no extension)"
)
TORCH_SUGGESTED = "2.13.0"  # the CPU suite's torch (./run installs it too)
NO_TORCH = (
    "fused_accum builds its C++ extension against the installed torch, and {python} has no torch.\n"
    "Install torch first: `pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu` (the "
    "CPU build; any {spec} works, a CUDA build for the CUDA kernels), then `pip install --no-build-isolation .`"
)
# Written next to fused_accum._C: the torch it was compiled against (read by fused_accum/extension.py).
BUILD_RECORD = "_C.build.json"


def _log(msg):
    print(f"[fused_accum setup] {msg}", file=sys.stderr)


def _torch_spec():
    """The supported range, as pyproject.toml declares it (its dependencies line)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        found = re.search(r'"(torch\s*[<>=~!][^"]*)"', f.read())
    return found.group(1).replace(" ", "") if found else "torch>=2.11,<2.15"


def _torch_outside_build_env():
    """Whether this interpreter imports torch without pip's build isolation, which replaces
    PYTHONPATH with its own overlay of the build requirements and turns off the user site."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
    return probe.returncode == 0


def _import_torch():
    try:
        import torch
    except ImportError:
        if _torch_outside_build_env():
            raise SystemExit(ISOLATED) from None
        raise SystemExit(NO_TORCH.format(python=sys.executable, pin=TORCH_SUGGESTED, spec=_torch_spec())) from None
    return torch


def _toolkit_root(nvcc):
    """The CUDA toolkit directory of `nvcc`, which may be a wrapper script outside the toolkit
    (here /usr/local/bin/nvcc execs /usr/local/cuda-13.0/bin/nvcc): nvcc's dry run prints TOP."""
    guess = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists(os.path.join(guess, "include", "cuda_runtime.h")):
        return guess
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cu")
        open(src, "w").close()
        out = subprocess.run([nvcc, "--dryrun", "-c", src], capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())
    return guess


def _cuda_home():
    """(CUDA toolkit root, "") or (None, why there is none). Searched as torch's cpp_extension
    searches: CUDA_HOME or CUDA_PATH, then the nvcc on PATH, then /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        if os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home, ""
        var = "CUDA_HOME" if os.environ.get("CUDA_HOME") else "CUDA_PATH"
        return None, f"{var}={home} has no bin/nvcc"
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        return _toolkit_root(nvcc), ""
    if os.path.exists(os.path.join(DEFAULT_CUDA_HOME, "bin", "nvcc")):
        return DEFAULT_CUDA_HOME, ""
    return (
        None,
        f"CUDA_HOME and CUDA_PATH are not set, nvcc is not on PATH and {DEFAULT_CUDA_HOME}/bin/nvcc does not exist",
    )


def _cuda_plan():
    """(build CUDA?, CUDA home, reason when not)."""
    mode = os.environ.get("FUSED_ACCUM_BUILD_CUDA", "")
    if mode == "0":
        return False, None, "FUSED_ACCUM_BUILD_CUDA=0"
    torch = _import_torch()

    home, why = _cuda_home()
    if home and torch.version.cuda is None:
        home, why = None, f"torch {torch.__version__} is a CPU-only build"
    if mode == "1" and home is None:
        raise SystemExit(f"FUSED_ACCUM_BUILD_CUDA=1 but the CUDA kernels cannot be built: {why}")
    return home is not None, home, why


def _nvidia_wheel_dirs():
    """Include and library dirs of the CUDA runtime that pip's torch brings (nvidia/cu13/...).
    Torch's CUDA headers include the runtime's; a minimal toolkit may lack what the wheel has."""
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    major = (torch.version.cuda or "").split(".")[0]
    base = os.path.join(site, "nvidia", f"cu{major}")
    inc, lib = os.path.join(base, "include"), os.path.join(base, "lib")
    return (inc if os.path.isdir(inc) else None), (lib if os.path.isdir(lib) else None)


def _build_ext_class(cpp_extension, tag, record):
    """BuildExtension with a fixed build folder: pip install -e builds in a fresh temporary folder
    each time, which recompiles everything (~20 s for the CPU kernels on 2 cores); a fixed one lets
    ninja recompile only what changed. `tag` keeps objects of different torch/CUDA builds apart.
    After the build, `record` (the torch built against) is written next to each extension: in
    build_lib for a wheel, in the source tree for an in-place or editable build."""

    class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(ROOT, "build", f"ext-{tag}")

        def run(self):
            super().run()  # setuptools builds in build_lib, then copies to the source if inplace
            for ext in self.extensions:
                path = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), BUILD_RECORD)
                with open(path, "w") as f:
                    json.dump(record, f, indent=1)
                    f.write("\n")
                _log(f"recorded the torch built against in {os.path.relpath(path, ROOT)}: torch {record['torch']}")

    return BuildExt


def _build_record(torch, cuda_kernels):
    return {
        "torch": str(torch.__version__),
        "torch_git": torch.version.git_version,
        "torch_cuda": torch.version.cuda,
        "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
        "cuda_kernels": cuda_kernels,
    }


def _ext_modules():
    if os.environ.get("FUSED_ACCUM_NO_EXT") == "1":
        _log("FUSED_ACCUM_NO_EXT=1: not building fused_accum._C")
        return [], {}
    build_cuda, cuda_home, why_not = _cuda_plan()
    if build_cuda:
        # cpp_extension reads CUDA_HOME when imported: set it first, or it guesses from the
        # nvcc on PATH and takes /usr/local for /usr/local/bin/nvcc.
        os.environ["CUDA_HOME"] = cuda_home
    torch = _import_torch()
    from torch.utils import cpp_extension

    # ninja jobs: one per core up to 8 (a CUDA build's 8 sources gain nothing past that); 2 on CI machines.
    os.environ.setdefault("MAX_JOBS", str(min(8, os.cpu_count() or 1)))
    csrc = lambda *names: [
        os.path.relpath(p, ROOT) for n in names for p in sorted(glob.glob(os.path.join(ROOT, "csrc", n)))
    ]  # noqa: E731
    sources = csrc("module.cpp", "hooks.cpp", "triton_plans.cpp", "bindings.cpp", "cpu/kernels.cpp")
    # -fopenmp, as torch's own C++ extensions are built on Linux: without _OPENMP,
    # at::parallel_for (an inline template in torch's headers) runs the whole range on the calling
    # thread. The extension links the libgomp.so.1 that torch already loaded (same soname), so
    # torch.set_num_threads governs our kernels too.
    # -fno-math-errno and -fno-trapping-math let GCC vectorise sqrtf and the branch-free fp16
    # conversions (they change no result). -ffp-contract=off: the only FMAs are the explicit
    # fmaf() of csrc/math.h, which reproduce torch's fused CPU optimizers bit for bit; GCC's
    # default (fast) would contract other products and round differently per SIMD clone.
    # csrc/ is deliberately not an include dir: csrc/math.h would shadow <math.h>.
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    link = ["-fopenmp"]
    _log(
        "CPU kernels: OpenMP (-fopenmp: at::parallel_for uses torch's threads), SIMD clones for "
        "x86-64-v4 (AVX-512), x86-64-v3 (AVX2+FMA) and baseline, chosen at load time"
    )
    if not build_cuda:
        _log(f"building the CPU kernels only: {why_not}")
        ext = cpp_extension.CppExtension(
            "fused_accum._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link
        )
        record = _build_record(torch, cuda_kernels=False)
        return [ext], {"build_ext": _build_ext_class(cpp_extension, f"torch{torch.__version__}", record)}

    _log(f"building the CPU and CUDA kernels with {cuda_home}/bin/nvcc")
    sources += csrc("bindings_cuda.cpp", "cuda/*.cu")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
    gencode.append(f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}")
    # -fmad=false: nvcc would contract a*b + c on its own; math.h writes the FMAs the reference
    # has explicitly, so the CUDA kernels round as the CPU kernels and the reference do.
    nvcc = ["-O3", "-lineinfo", "-fmad=false", "-Xptxas", "-v"] + gencode  # -v: registers and spills, per kernel
    include_dir, lib_dir = _nvidia_wheel_dirs()
    # The wheel's headers come after the toolkit's (-idirafter): they only fill in what the
    # toolkit lacks, so nvcc's own headers always win. Only the .cpp files include torch's
    # CUDA headers; the .cu files include none.
    cxx_cuda = cxx + ["-DFA_WITH_CUDA=1"] + (["-idirafter", include_dir] if include_dir else [])
    ext = cpp_extension.CUDAExtension(
        "fused_accum._C",
        sources,
        extra_compile_args={"cxx": cxx_cuda, "nvcc": nvcc},
        extra_link_args=link,
    )
    # The wheel's runtime is libcudart.so.13 only (no unversioned libcudart.so to -lcudart
    # against): link that file by name when the toolkit has no libcudart.so either.
    toolkit_libs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    if lib_dir and not any(os.path.exists(os.path.join(d, "libcudart.so")) for d in toolkit_libs):
        runtime = sorted(glob.glob(os.path.join(lib_dir, "libcudart.so.*")))
        if runtime:
            ext.libraries = [":" + os.path.basename(runtime[0]) if l == "cudart" else l for l in ext.libraries]
            ext.library_dirs.append(lib_dir)
    record = _build_record(torch, cuda_kernels=True)
    return [ext], {"build_ext": _build_ext_class(cpp_extension, f"torch{torch.__version__}-cuda", record)}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

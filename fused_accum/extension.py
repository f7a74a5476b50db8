"""Loads fused_accum._C, the C++/CUDA extension, once: the hooks (fused_accum.arrivals) and the
extension backend (fused_accum.backends.ext) both take it from here.

A C++ extension only runs with the torch it was compiled against (torch has no stable C++ ABI):
loaded into another one it fails with an undefined symbol, or crashes. So the torch recorded at
build time (``_C.build.json``, written by setup.py next to ``_C``) is compared with the installed
one first; on a difference ``_C`` is not loaded and one warning names both versions and the
command that rebuilds it. Without ``_C`` (``FUSED_ACCUM_NO_EXT=1``, at build time or at run time; a failed build) this module
still imports: ``_C`` is None and ``WHY_NOT`` says why, once in the log too.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
from typing import Optional

import torch

logger = logging.getLogger("fused_accum")

BUILD_RECORD = "_C.build.json"  # setup.py's name for it
REBUILD = (
    "rebuild it against this torch: pip install --no-build-isolation --no-deps --force-reinstall "
    "--no-cache-dir <fused_accum source or URL> (in a checkout: pip install --no-build-isolation --no-deps -e .)"
)


def _release(version) -> str:
    """2.13.0 of 2.13.0+cpu: CPU and CUDA builds of one release share torch's C++ ABI."""
    return str(version).split("+")[0]


def _built_against(so_path: str) -> Optional[str]:
    """The torch version recorded next to the extension at ``so_path``, or None when there is no
    readable record (a build by an older setup.py: then loading it decides)."""
    try:
        with open(os.path.join(os.path.dirname(so_path), BUILD_RECORD)) as f:
            return str(json.load(f)["torch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _load():
    """(fused_accum._C or None, "" or why it is not loaded). Warns once when an extension is
    there but was built for another torch or fails to load; logs once when none was built or
    ``FUSED_ACCUM_NO_EXT=1`` asks for none (./run demo, while the extension built is older than
    its sources: the Python beside it may need the new one)."""
    if os.environ.get("FUSED_ACCUM_NO_EXT") == "1":
        why = "FUSED_ACCUM_NO_EXT=1: fused_accum._C is not loaded"
        logger.info("fused_accum: C++ extension unavailable (%s)", why)
        return None, why
    spec = importlib.util.find_spec("fused_accum._C")
    if spec is None or spec.origin is None:  # FUSED_ACCUM_NO_EXT=1, or a failed build
        why = "fused_accum._C is not built (see setup.py: the build needs torch importable, and a C++ compiler)"
        logger.info("fused_accum: C++ extension unavailable (%s)", why)
        return None, why
    built = _built_against(spec.origin)
    if built is not None and _release(built) != _release(torch.__version__):
        why = (
            f"fused_accum._C was built against torch {built} but torch {torch.__version__} is installed, so it "
            f"is not loaded and fused_accum runs on its reference/Triton backends; {REBUILD}"
        )
        warnings.warn(why, RuntimeWarning, stacklevel=3)
        return None, why
    try:
        from fused_accum import _C
    except ImportError as err:  # an undefined symbol: built for another torch (or a broken build)
        why = (
            f"fused_accum._C (built against torch {built or 'unrecorded'}) does not load with torch "
            f"{torch.__version__}: {err}; fused_accum runs on its reference/Triton backends; {REBUILD}"
        )
        warnings.warn(why, RuntimeWarning, stacklevel=3)
        return None, why
    return _C, ""


_C, WHY_NOT = _load()


def swap_storages(a: torch.Tensor, b: torch.Tensor) -> None:
    """Swap the memory of two same-sized CPU buffers, each the whole of its storage (offset 0,
    contiguous, all its bytes; not the same storage), so that every view of either (offload's
    ``opt.state`` tensors, its cached slot views) sees the other's values.

    With ``_C``: in O(1), by exchanging the two StorageImpls' memory (their DataPtrs, each with
    its deleter: each block is freed once, by the storage holding it last); no element moves,
    and no version counter moves (a view's ``_version`` is its tensor's, not its memory's).
    Without it (``FUSED_ACCUM_NO_EXT=1``, a failed build): an honest swap of the values through
    a temporary, three copies of the buffer, which do move ``a``'s and ``b``'s version counters;
    the same checks first."""
    if _C is not None:
        _C.swap_storages(a, b)
        return
    for x in (a, b):
        if x.device.type != "cpu":
            raise RuntimeError(f"swap_storages: both tensors must be on the CPU, got {a.device} and {b.device}")
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa._cdata == sb._cdata:
        raise RuntimeError("swap_storages: the two tensors share their storage")
    for x, st in ((a, sa), (b, sb)):
        if x.storage_offset() != 0 or not x.is_contiguous() or x.nbytes != st.nbytes():
            raise RuntimeError(
                "swap_storages: each tensor must be the whole of its storage (contiguous, offset 0, all its bytes)"
            )
    if sa.nbytes() != sb.nbytes():
        raise RuntimeError(f"swap_storages: the storages differ in size ({sa.nbytes()} and {sb.nbytes()} bytes)")
    with torch.no_grad():
        a_bytes, b_bytes = a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)
        kept = a_bytes.clone()
        a_bytes.copy_(b_bytes)
        b_bytes.copy_(kept)

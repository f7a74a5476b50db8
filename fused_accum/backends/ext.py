"""The C++/CUDA extension backend (names "cpu" and "cuda"): ``torch.ops.fused_accum_ext.*``.

``fused_accum._C`` (built by setup.py from csrc/, loaded by :mod:`fused_accum.extension`)
registers the operators' CPU and, when built with nvcc, CUDA kernels (``TORCH_LIBRARY_IMPL``).
Their schemas are not written in C++: this module defines them here, from the declarations in
:mod:`fused_accum.ops` (:func:`fused_accum.ops.ext_schemas`), after ``_C`` has registered its
kernels, and the dispatcher then checks each kernel's C++ parameter types against its schema. A
``_C`` whose kernels do not match (a build older than the declarations) is refused with one
warning that quotes the dispatcher and says how to rebuild, and the package falls back to the
reference (or Triton) backend, as it does for a ``_C`` built for another torch.

It registers fake implementations so that ``torch.compile`` can trace the operators (all of
them mutate their arguments in place and return nothing), and exposes the backend contract of
:mod:`fused_accum.backends.reference`: ``accumulate`` with its flat arguments, ``fold_pieces``,
and ``step(op, t, s, h)`` for every declared step op (the records in their schema's order).
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional

import torch
from torch import Tensor

from .. import ops
from ..extension import REBUILD
from ..extension import WHY_NOT as _WHY_NOT
from ..extension import _C

OPS = tuple(ops.ext_schemas())  # the operator names: accumulate_, fold_pieces_, then each step op's


def _dispatcher_says(err: Exception) -> str:
    """The dispatcher's refusal without its C++ stack: the operator, both schemas, the reason."""
    lines = str(err).splitlines()
    kept = [line.strip() for line in lines if not line.startswith(("Exception raised from", "frame #"))]
    return " ".join(line for line in kept if line)


def _define() -> tuple:
    """(the library holding the fused_accum_ext:: schemas and fakes, "") or (None, why not)."""
    lib = torch.library.Library("fused_accum_ext", "DEF")
    try:
        for text in ops.ext_schemas().values():
            lib.define(text)
    except RuntimeError as err:  # a kernel of _C with other parameter types than declared
        lib._destroy()
        why = (
            f"fused_accum._C's kernels do not take the arguments fused_accum.ops declares, so it is not used "
            f"and fused_accum runs on its reference/Triton backends ({_dispatcher_says(err)}); {REBUILD}"
        )
        warnings.warn(why, RuntimeWarning, stacklevel=2)
        return None, why

    # The ops only mutate their (already allocated) arguments, so under FakeTensor there is
    # nothing to compute or allocate.
    def fake(*args, **kwargs):
        return None

    for name in OPS:
        torch.library.register_fake(f"fused_accum_ext::{name}", fake, lib=lib)
    return lib, ""


_LIB, _WHY_NOT_DEFINED = _define() if _C is not None else (None, _WHY_NOT)


def unavailable_reason(name: str) -> str:
    """ "" when fused_accum._C has kernels for backend ``name`` ("cpu" or "cuda"), else why not."""
    if _LIB is None:
        return _WHY_NOT_DEFINED
    if name == "cuda" and not _C.built_with_cuda:
        return (
            "fused_accum._C was built without CUDA kernels (it needs nvcc and a CUDA build of "
            "torch at install time; FUSED_ACCUM_BUILD_CUDA=1 makes the build fail instead)"
        )
    return ""


def accumulate(
    acc: Tensor,
    offsets: Tensor,
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor] = None,
    sumsq: Optional[Tensor] = None,
) -> None:
    torch.ops.fused_accum_ext.accumulate_(acc, offsets, grads, float(alpha), bool(overwrite), found_inf, sumsq)


@functools.lru_cache(maxsize=None)
def _has_fold_kernel(key: str) -> bool:
    """Whether _C registered a fold_pieces_ kernel for dispatch key ``key`` (a _C built before
    the op was declared has none: then the reference runs it, on any device, in the same bits)."""
    if _LIB is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("fused_accum_ext::fold_pieces_", key)
    except RuntimeError:  # the operator is not defined
        return False


def fold_pieces(acc: Tensor, pieces: List[Tensor], overwrite: bool) -> None:
    """reference.fold_pieces in C++ (CPU: one pass over acc) or CUDA (one launch per 128 pieces):
    fused_accum_ext::fold_pieces_, or the reference where _C predates it."""
    if _has_fold_kernel("CUDA" if acc.is_cuda else "CPU"):
        torch.ops.fused_accum_ext.fold_pieces_(acc, pieces, bool(overwrite))
    else:
        from . import reference

        reference.fold_pieces(acc, pieces, overwrite)


def step(op: ops.StepOp, t: ops.StepTensors, s, h) -> None:
    """The reference's spec of ``op`` in C++ (CPU) or CUDA: its records flattened into the
    arguments of ``fused_accum_ext::<op>_`` (``ops.adam_step``'s into ``adam_step_``'s), whose
    schema the declaration gave (the C++ kernels are instantiated per algorithm from
    csrc/math.h)."""
    getattr(torch.ops.fused_accum_ext, f"{op.name}_")(*op.flatten(t, s, h))

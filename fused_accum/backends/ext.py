"""The C++/CUDA extension backend (names "cpu" and "cuda"): ``torch.ops.fused_accum_ext.*``.

``fused_accum._C`` (built by setup.py from csrc/) registers the operators with ``TORCH_LIBRARY``
and their CPU and, when built with nvcc, CUDA kernels. This module loads it, registers fake
implementations so that ``torch.compile`` can trace the operators (all of them mutate their
arguments in place and return nothing), and exposes the four functions of the backend contract
with the signatures of :mod:`fused_accum.backends.reference`.

Without ``_C`` the module still imports: ``unavailable_reason`` says why, once in the log too, and
backend selection falls back to the reference (or Triton) backend.

A C++ extension only runs with the torch it was compiled against (torch has no stable C++ ABI):
loaded into another one it fails with an undefined symbol, or crashes. So the torch recorded at
build time (``_C.build.json``, written by setup.py next to ``_C``) is compared with the installed
one first; on a difference ``_C`` is not loaded and one warning names both versions and the
command that rebuilds it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
from typing import List, Optional, Sequence

import torch
from torch import Tensor

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
    there but was built for another torch or fails to load; logs once when none was built."""
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


_C, _WHY_NOT = _load()

OPS = ("accumulate_", "sgd_step_", "adam_step_", "lion_step_")


def unavailable_reason(name: str) -> str:
    """ "" when fused_accum._C has kernels for backend ``name`` ("cpu" or "cuda"), else why not."""
    if _C is None:
        return _WHY_NOT
    if name == "cuda" and not _C.built_with_cuda:
        return (
            "fused_accum._C was built without CUDA kernels (it needs nvcc and a CUDA build of "
            "torch at install time; FUSED_ACCUM_BUILD_CUDA=1 makes the build fail instead)"
        )
    return ""


def _register_fakes() -> None:
    # The ops only mutate their (already allocated) arguments, so under FakeTensor there is
    # nothing to compute or allocate.
    def fake(*args, **kwargs):
        return None

    for op in OPS:
        torch.library.register_fake(f"fused_accum_ext::{op}")(fake)


if _C is not None:
    _register_fakes()


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


def sgd_step(
    params: List[Tensor],
    momentum_bufs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    *,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    lp_params: Sequence[Tensor] = (),
    grads: Sequence[Tensor] = (),
    grad_alpha: float = 1.0,
    grads_overwrite: bool = False,
    found_inf: Optional[Tensor] = None,
) -> None:
    torch.ops.fused_accum_ext.sgd_step_(
        list(params),
        list(momentum_bufs),
        list(accs),
        steps,
        lr,
        coef,
        float(momentum),
        float(dampening),
        float(weight_decay),
        bool(nesterov),
        bool(maximize),
        list(lp_params),
        list(grads),
        float(grad_alpha),
        bool(grads_overwrite),
        found_inf,
    )


def adam_step(
    params: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    lp_params: Sequence[Tensor] = (),
    grads: Sequence[Tensor] = (),
    grad_alpha: float = 1.0,
    grads_overwrite: bool = False,
    found_inf: Optional[Tensor] = None,
    max_exp_avg_sqs: Sequence[Tensor] = (),
) -> None:
    torch.ops.fused_accum_ext.adam_step_(
        list(params),
        list(exp_avgs),
        list(exp_avg_sqs),
        list(max_exp_avg_sqs),
        list(accs),
        steps,
        lr,
        coef,
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(decoupled),
        bool(maximize),
        list(lp_params),
        list(grads),
        float(grad_alpha),
        bool(grads_overwrite),
        found_inf,
    )


def lion_step(
    params: List[Tensor],
    exp_avgs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    *,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
    lp_params: Sequence[Tensor] = (),
    grads: Sequence[Tensor] = (),
    grad_alpha: float = 1.0,
    grads_overwrite: bool = False,
    found_inf: Optional[Tensor] = None,
) -> None:
    torch.ops.fused_accum_ext.lion_step_(
        list(params),
        list(exp_avgs),
        list(accs),
        steps,
        lr,
        coef,
        float(beta1),
        float(beta2),
        float(weight_decay),
        bool(maximize),
        list(lp_params),
        list(grads),
        float(grad_alpha),
        bool(grads_overwrite),
        found_inf,
    )

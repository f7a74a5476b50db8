"""The C++/CUDA extension backend (names "cpu" and "cuda"): ``torch.ops.fused_accum_ext.*``.

``fused_accum._C`` (built by setup.py from csrc/) registers the operators with ``TORCH_LIBRARY``
and their CPU and, when built with nvcc, CUDA kernels. This module loads it, registers fake
implementations so that ``torch.compile`` can trace the operators (all of them mutate their
arguments in place and return nothing), and exposes the four functions of the backend contract
with the signatures of :mod:`fused_accum.backends.reference`.

Without ``_C`` the module still imports: ``unavailable_reason`` says why, once in the log too, and
backend selection falls back to the reference (or Triton) backend.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch
from torch import Tensor

logger = logging.getLogger("fused_accum")

try:
    from fused_accum import _C
except ImportError as err:  # not built (FUSED_ACCUM_NO_EXT=1, a failed build) or built for another torch
    _C = None
    _WHY_NOT = f"fused_accum._C is not built: {err}"
    logger.info("fused_accum: C++ extension unavailable (%s)", _WHY_NOT)
else:
    _WHY_NOT = ""

OPS = ("accumulate_", "sgd_step_", "adam_step_", "lion_step_")


def unavailable_reason(name: str) -> str:
    """"" when fused_accum._C has kernels for backend ``name`` ("cpu" or "cuda"), else why not."""
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
        list(params), list(momentum_bufs), list(accs), steps, lr, coef,
        float(momentum), float(dampening), float(weight_decay), bool(nesterov), bool(maximize),
        list(lp_params), list(grads), float(grad_alpha), bool(grads_overwrite), found_inf,
    )  # fmt: skip


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
        list(params), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs), list(accs), steps,
        lr, coef,
        float(beta1), float(beta2), float(eps), float(weight_decay), bool(decoupled),
        bool(maximize), list(lp_params), list(grads), float(grad_alpha), bool(grads_overwrite),
        found_inf,
    )  # fmt: skip


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
        list(params), list(exp_avgs), list(accs), steps, lr, coef,
        float(beta1), float(beta2), float(weight_decay), bool(maximize),
        list(lp_params), list(grads), float(grad_alpha), bool(grads_overwrite), found_inf,
    )  # fmt: skip

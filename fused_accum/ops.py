"""The operations of fused_accum, each declared once as a ``torch.library`` custom op.

Declaring them as custom ops (with fake implementations, which for these mutate-only ops do
nothing) lets ``torch.compile`` trace a training step that calls them without a graph break.
Optional tensor lists (``lp_params``, the fused step's ``grads``) are passed as empty lists when
absent: custom-op schemas have no optional list type. Each op takes the name of an
already-resolved backend (see :mod:`fused_accum.backends`) and
forwards to that backend's function; the contracts live in :mod:`fused_accum.backends.reference`.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from . import backends


@torch.library.custom_op("fused_accum::accumulate_", mutates_args=("accs", "found_inf", "sumsq"))
def accumulate_(
    accs: List[Tensor],
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor],
    sumsq: Optional[Tensor],
    backend: str,
) -> None:
    backends.get(backend).accumulate(accs, grads, alpha, overwrite, found_inf, sumsq)


@accumulate_.register_fake
def _(accs, grads, alpha, overwrite, found_inf, sumsq, backend):
    return None


@torch.library.custom_op(
    "fused_accum::sgd_step_", mutates_args=("params", "momentum_bufs", "lp_params")
)
def sgd_step_(
    params: List[Tensor],
    momentum_bufs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    lp_params: List[Tensor],
    grads: List[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    backend: str,
) -> None:
    backends.get(backend).sgd_step(
        params, momentum_bufs, accs, steps, lr, coef,
        momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
        maximize=maximize, lp_params=lp_params, grads=grads, grad_alpha=grad_alpha,
        grads_overwrite=grads_overwrite, found_inf=found_inf,
    )  # fmt: skip


@sgd_step_.register_fake
def _(*args):
    return None


@torch.library.custom_op(
    "fused_accum::adam_step_", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "lp_params")
)
def adam_step_(
    params: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    lp_params: List[Tensor],
    grads: List[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    backend: str,
) -> None:
    backends.get(backend).adam_step(
        params, exp_avgs, exp_avg_sqs, accs, steps, lr, coef,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
        maximize=maximize, lp_params=lp_params, grads=grads, grad_alpha=grad_alpha,
        grads_overwrite=grads_overwrite, found_inf=found_inf,
    )  # fmt: skip


@adam_step_.register_fake
def _(*args):
    return None


@torch.library.custom_op("fused_accum::lion_step_", mutates_args=("params", "exp_avgs", "lp_params"))
def lion_step_(
    params: List[Tensor],
    exp_avgs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
    lp_params: List[Tensor],
    grads: List[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    backend: str,
) -> None:
    backends.get(backend).lion_step(
        params, exp_avgs, accs, steps, lr, coef,
        beta1=beta1, beta2=beta2, weight_decay=weight_decay, maximize=maximize,
        lp_params=lp_params, grads=grads, grad_alpha=grad_alpha,
        grads_overwrite=grads_overwrite, found_inf=found_inf,
    )  # fmt: skip


@lion_step_.register_fake
def _(*args):
    return None

"""Reference backend: every op in plain fp32 PyTorch, next to its contract.

This module is the specification. Every other backend (Triton, the C++/CUDA extension) must
produce what these functions produce, to the tolerance its tests state, and is tested against
them. It is also the fallback wherever no kernel backend is available, so it must be correct
for any device, any float dtype, and any strides.

Conventions shared by all ops (and so by all backends):

- ``accs`` are 1-D contiguous fp32 views into a flat accumulator buffer, one per parameter.
- ``grads`` are the incoming gradients, bf16/fp16/fp32, any shape and strides, read in their own
  dtype; ``grads[i].numel() == accs[i].numel()``.
- ``params`` are what an optimizer step updates in place: the fp32 master copies, or the
  parameters themselves when they have no master (fp32 params, or ``master_weights=False``).
  ``lp_params``, when given, are the low-precision parameters that receive ``params`` rounded
  to their dtype after the update; an empty ``lp_params`` means there are none.
- Optimizer state tensors (``exp_avgs``, ``exp_avg_sqs``, ``momentum_bufs``) are fp32.
- ``steps`` is a 1-D fp32 tensor with the step count of each tensor in the list, already
  counting this step (so 1 on the first step). ``lr`` and ``coef`` are 0-d fp32 device tensors:
  the step reads them on the device, so changing them neither recompiles nor syncs the host.
- ``coef`` multiplies the accumulated gradient before use: normalisation (1/num_items),
  loss-scale unscaling and clipping folded into one scalar.
- ``found_inf`` is a 0-d fp32 tensor, 0 or 1. When it is non-zero the step changes nothing.
- A non-empty ``grads`` on a step op fuses the window's last micro-batch into the step: the gradient used is
  ``coef * (grad_alpha * grad + (0 if grads_overwrite else acc))`` and ``acc`` is not written
  (it is ready to be overwritten by the next window either way).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor


def accumulate(
    accs: List[Tensor],
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor] = None,
    sumsq: Optional[Tensor] = None,
) -> None:
    """``acc = alpha * grad + (0 if overwrite else acc)`` for every pair, in fp32.

    When given, ``found_inf`` is set to 1 if any written acc value is inf/nan (it is never reset
    to 0 here, so several calls OR together), and ``sumsq`` gets the sum of squares of every
    written acc value added to it (for global-norm clipping). Both describe the values written,
    not the incoming gradients: on the window's last micro-batch they describe the window.
    """
    for acc, grad in zip(accs, grads):
        new = grad.reshape(-1).float() * alpha
        if not overwrite:
            new = acc + new
        acc.copy_(new)
        if found_inf is not None:
            found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(acc)).any().float()))
        if sumsq is not None:
            sumsq.add_(torch.dot(acc, acc))


def _effective_grad(acc, grad, coef, grad_alpha, grads_overwrite, maximize):
    """The gradient a step uses: coef * (accumulated gradient), negated when maximizing."""
    g = acc
    if grad is not None:
        g_new = grad.reshape(-1).float() * grad_alpha
        g = g_new if grads_overwrite else acc + g_new
    g = g * coef
    return -g if maximize else g


def _commit(found_inf, pairs):
    """Write each (destination, new value) pair unless found_inf is set (no host sync)."""
    for dst, new in pairs:
        if found_inf is not None:
            new = torch.where(found_inf > 0, dst.reshape(-1).float(), new)
        dst.copy_(new.view_as(dst))


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
    """torch.optim.SGD's update. ``momentum_bufs`` may be empty when momentum == 0.

    As in torch, the momentum buffer starts as a copy of the first gradient (no dampening):
    a tensor is on its first step when its ``steps`` entry is 1.
    """
    for i, p in enumerate(params):
        grad = grads[i] if grads else None
        g = _effective_grad(accs[i], grad, coef, grad_alpha, grads_overwrite, maximize)
        p32 = p.reshape(-1).float()
        if weight_decay != 0:
            g = g + weight_decay * p32
        writes = []
        if momentum != 0:
            buf = momentum_bufs[i]
            first = steps[i] == 1
            new_buf = torch.where(first, g, momentum * buf + (1 - dampening) * g)
            writes.append((buf, new_buf))
            g = g + momentum * new_buf if nesterov else new_buf
        new_p = p32 - lr * g
        writes.append((p, new_p))
        if lp_params:
            writes.append((lp_params[i], new_p))
        _commit(found_inf, writes)


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
) -> None:
    """torch.optim.Adam (``decoupled=False``) / AdamW (``decoupled=True``), without amsgrad."""
    for i, p in enumerate(params):
        grad = grads[i] if grads else None
        g = _effective_grad(accs[i], grad, coef, grad_alpha, grads_overwrite, maximize)
        p32 = p.reshape(-1).float()
        if weight_decay != 0:
            if decoupled:
                p32 = p32 * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p32
        m = exp_avgs[i] * beta1 + g * (1 - beta1)
        v = exp_avg_sqs[i] * beta2 + g * g * (1 - beta2)
        step = steps[i]
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = torch.sqrt(1 - beta2**step)
        denom = torch.sqrt(v) / bias_correction2_sqrt + eps
        new_p = p32 - (lr / bias_correction1) * (m / denom)
        writes = [(exp_avgs[i], m), (exp_avg_sqs[i], v), (p, new_p)]
        if lp_params:
            writes.append((lp_params[i], new_p))
        _commit(found_inf, writes)


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
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay.

    ``steps`` is unused by the math (Lion has no bias correction) but kept so every step op has
    the same shape of arguments.
    """
    del steps
    for i, p in enumerate(params):
        grad = grads[i] if grads else None
        g = _effective_grad(accs[i], grad, coef, grad_alpha, grads_overwrite, maximize)
        p32 = p.reshape(-1).float() * (1 - lr * weight_decay)
        m = exp_avgs[i]
        direction = torch.sign(m * beta1 + g * (1 - beta1))
        new_p = p32 - lr * direction
        new_m = m * beta2 + g * (1 - beta2)
        writes = [(m, new_m), (p, new_p)]
        if lp_params:
            writes.append((lp_params[i], new_p))
        _commit(found_inf, writes)

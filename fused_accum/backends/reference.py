"""Reference backend: every op in plain fp32 PyTorch, next to its contract.

This module is the specification. Every other backend (Triton, the C++/CUDA extension) must
produce what these functions produce, to the tolerance its tests state, and is tested against
them. It is also the fallback wherever no kernel backend is available, so it must be correct
for any device, any float dtype, and any strides.

Conventions shared by all ops (and so by all backends):

- ``accumulate`` takes the flat accumulator itself, ``acc`` (1-D contiguous fp32), and the
  ``offsets`` (1-D int64 CPU tensor) where each gradient's slice starts: ``grads[i]`` goes to
  ``acc[offsets[i] : offsets[i] + grads[i].numel()]``. The slices are in increasing order and do
  not overlap (:func:`slice_starts` checks). One tensor and one offsets table, rather than a list
  of views, because the per-micro-batch call is the hot one: converting each list element from
  Python costs ~0.2 us, the whole kernel time of a 256-element slice on a CPU.
- The step ops take ``accs``, a list of 1-D contiguous fp32 views into that buffer, one per
  parameter, like every other list they take (they run once per window).
- ``grads`` are the incoming gradients, bf16/fp16/fp32, any shape and strides, read in their own
  dtype, one per accumulator slice.
- ``params`` are what an optimizer step updates in place: the fp32 master copies, or the
  parameters themselves when they have no master (fp32 params, or ``master_weights=False``).
  ``lp_params``, when given, are the low-precision parameters that receive ``params`` rounded
  to their dtype after the update; an empty ``lp_params`` means there are none.
- Optimizer state tensors (``exp_avgs``, ``exp_avg_sqs``, ``momentum_bufs``) are fp32.
- ``steps`` is a 1-D fp32 tensor with the step count of each tensor in the list, already
  counting this step (so 1 on the first step). ``lr`` and ``coef`` are one-element device
  tensors: the step reads them on the device, so changing them neither recompiles nor syncs the
  host. ``coef`` is fp32; ``lr`` is fp64 (what the optimizer passes) or fp32, and the step treats
  it as the double it holds, as torch's fused optimizers take lr (a tensor lr as
  ``lr.item<double>()``): every scalar derived from it (SGD's -lr, Adam's step size and decay
  factor, Lion's lr and decay factor) is formed in double and rounded to fp32 once, so a Python
  float lr not exact in fp32 (1e-3) steps as torch's does.
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


def slice_starts(acc: Tensor, offsets: Tensor, grads: Sequence[Tensor]) -> List[int]:
    """Check the layout ``accumulate`` takes and return the offsets as Python ints.

    ``acc`` 1-D contiguous fp32; ``offsets`` a 1-D int64 CPU tensor with one entry per gradient;
    each gradient on acc's device, its slice inside ``acc`` and after the previous one. A
    slice is as long as its gradient: that it is the right parameter's slice is the caller's
    to guarantee (the optimizer's gradients come from autograd, shaped like their params).
    The C++ binding makes the same checks (csrc/bindings.cpp, prepare_accumulate).
    """
    if acc.dtype != torch.float32 or acc.dim() != 1 or not acc.is_contiguous():
        raise ValueError(
            f"accumulate: acc must be a 1-D contiguous float32 tensor (the flat accumulator), "
            f"got {acc.dtype} of shape {tuple(acc.shape)} and strides {acc.stride()}"
        )
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.device.type != "cpu":
        raise ValueError(
            f"accumulate: offsets must be a 1-D int64 CPU tensor, got {offsets.dtype} of shape "
            f"{tuple(offsets.shape)} on {offsets.device}"
        )
    if len(offsets) != len(grads):
        raise ValueError(f"accumulate: offsets has {len(offsets)} entries but grads has {len(grads)} tensors")
    starts = offsets.tolist()
    end = 0  # where the previous slice ends
    for i, (start, grad) in enumerate(zip(starts, grads)):
        if grad.device != acc.device:
            raise ValueError(f"accumulate: grads[{i}] is on {grad.device}, expected {acc.device} (the device of acc)")
        if start < end:
            raise ValueError(
                f"accumulate: offsets[{i}] is {start}, before {end}, where the previous slice ends "
                f"(0 for the first): slices must be in increasing order and must not overlap"
            )
        if grad.numel() > acc.numel() - start:
            raise ValueError(
                f"accumulate: grads[{i}] ({grad.numel()} elements at offset {start}) runs past the "
                f"end of acc ({acc.numel()} elements)"
            )
        end = start + grad.numel()
    return starts


def accumulate(
    acc: Tensor,
    offsets: Tensor,
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor] = None,
    sumsq: Optional[Tensor] = None,
) -> None:
    """``acc[slice i] = alpha * grads[i] + (0 if overwrite else acc[slice i])``, in fp32, for
    the slices of :func:`slice_starts`; the rest of ``acc`` is not touched.

    When given, ``found_inf`` is set to 1 if any written acc value is inf/nan (it is never reset
    to 0 here, so several calls OR together), and ``sumsq`` gets the sum of squares of every
    written acc value added to it (for global-norm clipping). Both describe the values written,
    not the incoming gradients: on the window's last micro-batch they describe the window.
    """
    for start, grad in zip(slice_starts(acc, offsets, grads), grads):
        view = acc[start : start + grad.numel()]
        new = grad.reshape(-1).float() * alpha
        if not overwrite:
            new = view + new
        view.copy_(new)
        if found_inf is not None:
            found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(view)).any().float()))
        if sumsq is not None:
            sumsq.add_(torch.dot(view, view))


def _effective_grad(acc, grad, coef, grad_alpha, grads_overwrite, maximize):
    """The gradient a step uses: coef * (accumulated gradient), negated when maximizing."""
    g = acc
    if grad is not None:
        g_new = grad.reshape(-1).float() * grad_alpha
        g = g_new if grads_overwrite else acc + g_new
    g = g * coef
    return -g if maximize else g


def _fma(a: Tensor, b, c: Tensor) -> Tensor:
    """``a * b + c`` rounded once (a fused multiply-add), as torch's fused CPU optimizers compute
    it. ``b`` is a tensor or a Python float (rounded to fp32 first, as torch's kernels do).
    ``torch.addcmul`` is one FMA per element on the CPU (tests/test_kernels.py checks it against
    float64 arithmetic), so this stays plain fp32 PyTorch."""
    if not isinstance(b, Tensor):
        b = torch.tensor(b, dtype=torch.float32, device=c.device)
    return torch.addcmul(c, a, b)


def _sqrt(x: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (what the kernels' sqrtf gives). torch.sqrt of an
    fp32 CPU tensor is not: it differs in the last bit for ~17% of inputs (measured, torch 2.13,
    AVX2). The float64 root rounded to fp32 is correctly rounded (53 >= 2 * 24 + 2 bits)."""
    return torch.sqrt(x.double()).float()


def _f32(x: Tensor) -> Tensor:
    """A per-tensor scalar computed in float64 (as torch's fused optimizers compute them), rounded
    to fp32 once."""
    return x.to(torch.float32)


def _lr(lr: Tensor) -> Tensor:
    """The step's lr as a float64 tensor (exact for an fp32 one), after the check every backend
    makes (the C++ binding's check_lr, the triton launcher's)."""
    if lr.dtype not in (torch.float64, torch.float32) or lr.numel() != 1:
        raise ValueError(
            f"lr must be a one-element float64 or float32 tensor, got {lr.dtype} with {lr.numel()} elements"
        )
    return lr.double()


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
    a tensor is on its first step when its ``steps`` entry is 1. Each ``+`` of a product is one
    fused multiply-add where torch's fused CPU SGD has one, so fp32 params match it bit for bit.
    """
    neg_lr = _f32(-_lr(lr))  # torch's fused SGD: its double -lr rounded to fp32
    for i, p in enumerate(params):
        grad = grads[i] if grads else None
        g = _effective_grad(accs[i], grad, coef, grad_alpha, grads_overwrite, maximize)
        p32 = p.reshape(-1).float()
        if weight_decay != 0:
            g = _fma(p32, weight_decay, g)
        writes = []
        if momentum != 0:
            buf = momentum_bufs[i]
            first = steps[i] == 1
            new_buf = torch.where(first, g, _fma(g, 1 - dampening, buf * momentum))
            writes.append((buf, new_buf))
            g = _fma(new_buf, momentum, g) if nesterov else new_buf
        new_p = _fma(g, neg_lr, p32)
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
    max_exp_avg_sqs: Sequence[Tensor] = (),
) -> None:
    """torch.optim.Adam (``decoupled=False``) / AdamW (``decoupled=True``).

    A non-empty ``max_exp_avg_sqs`` (fp32, one per param) turns on amsgrad: the running maximum
    of ``exp_avg_sq`` is updated and the denominator uses it, as torch's ``amsgrad=True``.

    The order of operations is torch's fused CPU kernel's (so fp32 params match
    ``torch.optim.Adam(W)(fused=True)`` bit for bit): the bias corrections, the step size and
    the decoupled decay factor in float64, rounded to fp32 once; ``exp_avg`` by ``lerp``;
    ``exp_avg_sq`` and coupled weight decay by fused multiply-adds; two divides.
    """
    lr = _lr(lr)
    for i, p in enumerate(params):
        grad = grads[i] if grads else None
        g = _effective_grad(accs[i], grad, coef, grad_alpha, grads_overwrite, maximize)
        p32 = p.reshape(-1).float()
        step = steps[i].double()
        if weight_decay != 0:
            if decoupled:
                p32 = p32 * _f32(1 - lr * weight_decay)
            else:
                g = _fma(p32, weight_decay, g)
        m = torch.lerp(exp_avgs[i], g, 1 - beta1)
        v = _fma(g * (1 - beta2), g, exp_avg_sqs[i] * beta2)
        writes = [(exp_avgs[i], m), (exp_avg_sqs[i], v)]
        if max_exp_avg_sqs:
            v = torch.maximum(max_exp_avg_sqs[i], v)
            writes.append((max_exp_avg_sqs[i], v))
        neg_step_size = _f32(-lr / (1 - beta1**step))
        bias_correction2_sqrt = _f32(torch.sqrt(1 - beta2**step))
        denom = _sqrt(v) / bias_correction2_sqrt + eps
        new_p = p32 + (neg_step_size * m) / denom
        writes.append((p, new_p))
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
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay,
    as lucidrains/lion-pytorch computes it with torch ops (its ``add(alpha=)`` is one fused
    multiply-add on the CPU): the sign uses the old ``exp_avg``, which is updated afterwards.

    ``steps`` is unused by the math (Lion has no bias correction) but kept so every step op has
    the same shape of arguments.
    """
    del steps
    lr = _lr(lr)
    # lucidrains' ops with a Python float lr: add_(alpha=-lr) rounds lr to fp32, the decay
    # factor 1 - lr * weight_decay is formed in double
    lr32, decay = _f32(lr), _f32(1 - lr * weight_decay)
    for i, p in enumerate(params):
        grad = grads[i] if grads else None
        g = _effective_grad(accs[i], grad, coef, grad_alpha, grads_overwrite, maximize)
        p32 = p.reshape(-1).float() * decay
        m = exp_avgs[i]
        direction = torch.sign(_fma(g, 1 - beta1, m * beta1))
        new_p = p32 - lr32 * direction  # direction is -1, 0 or 1: the product is exact
        new_m = _fma(g, 1 - beta2, m * beta2)
        writes = [(m, new_m), (p, new_p)]
        if lp_params:
            writes.append((lp_params[i], new_p))
        _commit(found_inf, writes)

"""Reference backend: every op in plain fp32 PyTorch, next to its contract.

This module is the specification. Every other backend (Triton, the C++/CUDA extension) must
produce what these functions produce, to the tolerance its tests state, and is tested against
them. It is also the fallback wherever no kernel backend is available, so it must be correct
for any device, any float dtype, and any strides.

Conventions shared by all ops (and so by all backends):

- ``fold_pieces`` (:func:`fold_pieces`) sums same-sized pieces into one accumulator, in order.
- ``accumulate`` takes the flat accumulator itself, ``acc`` (1-D contiguous fp32), and the
  ``offsets`` (1-D int64 CPU tensor) where each gradient's slice starts: ``grads[i]`` goes to
  ``acc[offsets[i] : offsets[i] + grads[i].numel()]``. The slices are in increasing order and do
  not overlap (:func:`slice_starts` checks). One tensor and one offsets table, rather than a list
  of views, because the per-micro-batch call is the hot one: converting each list element from
  Python costs ~0.2 us, the whole kernel time of a 256-element slice on a CPU.
- Each step op takes three records, declared once in :mod:`fused_accum.ops`: ``t``, the
  :class:`~fused_accum.ops.StepTensors` every step takes (the tensor lists and device scalars
  below), ``s``, the op's optimizer-state lists (``op.states``: ``AdamStates``...), and ``h``,
  its hyper-parameters (``op.hyper``: ``fused_accum.algorithms.AdamHyper``...). Every backend
  runs them as ``step(op, t, s, h)``; here that is the spec function named for the op
  (:func:`sgd_step`, :func:`adam_step`, :func:`lion_step`, :func:`adagrad_step`,
  :func:`ademamix_step`), one per update rule.
- The step ops take ``accs``, a list of 1-D contiguous fp32 views into that buffer, one per
  parameter, like every other list they take (they run once per window).
- ``grads`` are the incoming gradients, bf16/fp16/fp32, any shape and strides, read in their own
  dtype, one per accumulator slice.
- ``params`` are what an optimizer step updates in place: the fp32 master copies, or the
  parameters themselves when they have no master (fp32 params, or ``master_weights=False``).
  ``lp_params``, when given, are the low-precision parameters that receive ``params`` rounded
  to their dtype after the update; an empty ``lp_params`` means there are none.
- Masters follow the weight, element by element (values decide, not version counters): with
  ``lp_params``, each element's master is first taken as ``float(lp)`` where the lp element's
  *bits* differ from the bits of the master rounded to lp's dtype (the rounding the step
  writes lp with, to nearest even), else the master as it is, and the update runs from that
  value (:func:`follow_weight`). A weight written from outside the optimizer (``p.data[mask] =
  0``, ``dist.broadcast(p)``, SAM's ``p.add_(e)`` then ``p.sub_(e)``, an EMA swap) moves no
  version counter reliably, and a stale master would write its old value back over the
  user's; only the elements whose weight no longer equals the master's rounding restart, so a
  write that changes no value keeps the master's full precision. Bits, not values: a NaN master
  whose rounding equals the stored NaN bits is kept, and -0.0 against +0.0 is a difference. It
  costs 2 B/param in the step (lp is read as well as written), and applies with fused
  micro-batches too. A skipped step writes nothing: the master stays, the next step adopts.
- ``remainders``, when given (exact 2-byte masters, issue 28): ``params`` are the bf16
  parameters themselves (any strides, updated in place) and ``remainders`` int16 tensors of
  the same sizes (1-D contiguous views of the optimizer's remainder buffer), the low halves of
  their fp32 masters; ``lp_params`` is then empty. Each step rebuilds the master,
  ``rebuild_master(param, remainder)``, applies exactly the fp32-master update to it, and
  writes ``split_master(new master)`` back into param and remainder (the contract and the tie
  rule: :func:`split_master`). From the same master the new master is the fp32-master mode's,
  bit for bit, wherever it is finite and below 3.3961e38 in magnitude (above, it becomes +-inf;
  a NaN, the canonical NaN); the bf16 weight differs from that mode's
  (``master.to(bfloat16)``) only at exact ties. Every (weight, remainder) pair rebuilds to a
  master that rounds to its weight, so a weight written from outside keeps its remainder and
  needs no reset (:func:`rebuild_master`). fp16 or fp32 params with remainders are an error.
- Optimizer state tensors (``exp_avgs``, ``exp_avg_sqs``, ``momentum_buffers``) are fp32.
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
- ``sources``, when given (issue 37), hold the old values of everything the step writes: the
  step reads them and writes the new values into the written lists (out of place: offload's
  double-buffered host state steps from its live buffers into their twins, and a commit is a
  swap). :func:`take_sources` says which tensor goes where; a skipped step copies them over.
- A skipped step (``found_inf``) writes no value: params, remainders, lp_params and state keep
  their bits (NaN payloads included: a remainder mode's master lives in those bits).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

# the formats' bits, which the ops below read and write (callers reach them here too)
from .master_bits import follow_weight, rebuild_master, rounded, split_master, widened

if TYPE_CHECKING:  # the records of the declarations (fused_accum.ops imports the backends)
    from ..ops import StepOp, StepTensors

    # each op's states record (ops.declare_step makes it: op.states) and hyper-parameter record
    # (fused_accum.algorithms declares it: op.hyper), NamedTuples both
    AdamStates = LionStates = SgdStates = AdagradStates = AdemamixStates = tuple
    AdamHyper = LionHyper = SgdHyper = AdagradHyper = AdEMAMixHyper = tuple


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


# --- fold_pieces: several pieces summed into one accumulator, in order (issue 38) -------------

_PIECE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fold_pieces(acc: Tensor, pieces: Sequence[Tensor]) -> None:
    """The layout ``fold_pieces`` takes, with the messages every backend gives (the C++
    binding's prepare_fold_pieces, the triton launcher's): ``acc`` 1-D contiguous fp32; at
    least one piece; each piece on acc's device with acc's numel (any shape and strides), all of
    one dtype among bf16, fp16 and fp32."""
    if acc.dtype != torch.float32 or acc.dim() != 1 or not acc.is_contiguous():
        raise ValueError(
            f"fold_pieces: acc must be a 1-D contiguous float32 tensor, got {acc.dtype} of shape "
            f"{tuple(acc.shape)} and strides {acc.stride()}"
        )
    if len(pieces) == 0:
        raise ValueError("fold_pieces: pieces is empty (at least one piece is needed)")
    dtype = pieces[0].dtype
    for i, piece in enumerate(pieces):
        if piece.dtype not in _PIECE_DTYPES:
            raise ValueError(f"fold_pieces: pieces[{i}] must be bfloat16, float16 or float32, got {piece.dtype}")
        if piece.dtype != dtype:
            raise ValueError(
                f"fold_pieces: pieces[{i}] is {piece.dtype} but pieces[0] is {dtype} (all pieces must have one dtype)"
            )
        if piece.device != acc.device:
            raise ValueError(
                f"fold_pieces: pieces[{i}] is on {piece.device}, expected {acc.device} (the device of acc)"
            )
        if piece.numel() != acc.numel():
            raise ValueError(f"fold_pieces: pieces[{i}] has {piece.numel()} elements but acc has {acc.numel()}")


def fold_pieces(acc: Tensor, pieces: List[Tensor], overwrite: bool) -> None:
    """``acc = (((acc + f32(pieces[0])) + f32(pieces[1])) + ...)``: one fp32 add per piece, in
    list order (the ranks' order), per element; with ``overwrite``, the sum starts from
    ``f32(pieces[0])`` itself rather than from acc (not from 0 + pieces[0]: a -0.0 stays -0.0).
    ``f32`` widens exactly (:func:`widened`). The order of the adds is fixed, so every backend
    gives these bits, except that which NaN a NaN result is (its payload, when both operands of
    an add are NaN; the CUDA kernels' canonical NaN) is not part of the contract. The pieces must
    not overlap acc."""
    check_fold_pieces(acc, pieces)
    total = widened(pieces[0]).clone() if overwrite else acc.clone()
    for piece in pieces[1:] if overwrite else pieces:
        total = total + widened(piece)
    acc.copy_(total)


def check_remainders(op: str, t: StepTensors) -> None:
    """The remainder mode's layout (see the module docstring), with the C++ binding's messages
    (csrc/bindings.cpp, prepare_step) and the triton launcher's."""
    if not t.remainders:
        return
    n = len(t.params)
    if len(t.remainders) != n:
        raise ValueError(f"{op}: remainders has {len(t.remainders)} tensors, expected 0 (none) or {n} (one per param)")
    if t.lp_params:
        raise ValueError(
            f"{op}: remainders and lp_params are exclusive: with remainders, params are the bf16 parameters"
        )
    for i, (p, r) in enumerate(zip(t.params, t.remainders)):
        if p.dtype != torch.bfloat16:
            raise ValueError(
                f"{op}: params[{i}] must be bfloat16 with remainders (the fp32 master is the bf16 parameter "
                f"plus an int16 remainder), got {p.dtype}"
            )
        if r.dtype != torch.int16:
            raise ValueError(f"{op}: remainders[{i}] must be int16, got {r.dtype}")
        if r.device != p.device:
            raise ValueError(f"{op}: remainders[{i}] is on {r.device}, expected {p.device} (the device of params[{i}])")
        if r.numel() != p.numel():
            raise ValueError(f"{op}: remainders[{i}] has {r.numel()} elements but params[{i}] has {p.numel()}")


def take_sources(op: str, t: StepTensors, states: Sequence[Sequence[Tensor]]) -> None:
    """Copy ``t.sources`` (empty: nothing to do) into what the step writes, before the step
    reads any of it: params, lp_params (if any), remainders (if any), then ``states`` (the state
    lists the step writes, in its record's order), ``sources[k * len(params) + i]`` into the k-th
    of these lists' tensor i. A source has its tensor's dtype and numel (any shape and strides);
    the copy is of the bits. The step that follows is the ordinary in-place one, so an
    out-of-place step is the in-place step bit for bit. The same checks, in the same words, as
    the C++ binding's (csrc/bindings.cpp, prepare_step)."""
    if not t.sources:
        return
    written = [t.params, *(x for x in (t.lp_params, t.remainders) if x), *states]
    n = len(t.params)
    if len(t.sources) != len(written) * n:
        raise ValueError(
            f"{op}: sources has {len(t.sources)} tensors, expected 0 (none) or {len(written) * n} "
            f"(one per tensor of the {len(written)} lists the step writes)"
        )
    for k, tensors in enumerate(written):
        for i, dst in enumerate(tensors):
            src = t.sources[k * n + i]
            if src.dtype != dst.dtype or src.numel() != dst.numel() or src.device != dst.device:
                raise ValueError(
                    f"{op}: sources[{k * n + i}] must be {dst.dtype} with {dst.numel()} elements on {dst.device} "
                    f"(what the step writes there), got {src.dtype} with {src.numel()} on {src.device}"
                )
            dst.copy_(src.reshape(dst.shape))


def _master(t: StepTensors, i: int) -> Tensor:
    """The fp32 value the step updates for tensor ``i``: the master rebuilt from the bf16 param
    and its remainder, else params[i] in fp32, following lp_params[i] where it was written
    from outside (:func:`follow_weight`)."""
    if t.remainders:
        return rebuild_master(t.params[i].reshape(-1), t.remainders[i].reshape(-1))
    master = t.params[i].reshape(-1).float()
    if t.lp_params:
        master = follow_weight(master, t.lp_params[i])
    return master


def _param_writes(t: StepTensors, i: int, new_p: Tensor) -> list:
    """Where the updated fp32 value goes: split into param and remainder, or params[i] (rounded
    to its dtype) and lp_params[i] (rounded to theirs)."""
    if t.remainders:
        weight, remainder = split_master(new_p)
        return [(t.params[i], weight), (t.remainders[i], remainder)]
    writes = [(t.params[i], new_p)]
    if t.lp_params:
        writes.append((t.lp_params[i], new_p))
    return writes


def _effective_grad(t: StepTensors, i: int, maximize: bool) -> Tensor:
    """The gradient a step uses for tensor ``i``: coef * (accumulated gradient, with the fused
    micro-batch's when ``t.grads`` are given), negated when maximizing."""
    g = t.accs[i]
    if t.grads:
        g_new = t.grads[i].reshape(-1).float() * t.grad_alpha
        g = g_new if t.grads_overwrite else g + g_new
    g = g * t.coef
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
    """Write each (destination, new value) pair unless found_inf is set (no host sync). The new
    value is rounded to the destination's dtype first (:func:`rounded`), so a skipped step keeps
    every bit of the destination (a round trip through fp32 would make a bf16 NaN 0x7FC0)."""
    for dst, new in pairs:
        new = rounded(new, dst.dtype)
        if found_inf is not None:
            new = torch.where(found_inf > 0, dst.reshape(-1), new)
        dst.copy_(new.view_as(dst))


def step(op: StepOp, t: StepTensors, s, h) -> None:
    """Step op ``op``: its spec, the function of this module named for it."""
    globals()[op.name](t, s, h)


def sgd_step(t: StepTensors, s: SgdStates, h: SgdHyper) -> None:
    """torch.optim.SGD's update. ``s.momentum_buffers`` may be empty when ``h.momentum == 0``.

    As in torch, the momentum buffer starts as a copy of the first gradient (no dampening):
    a tensor is on its first step when its ``steps`` entry is 1. Each ``+`` of a product is one
    fused multiply-add where torch's fused CPU SGD has one, so fp32 params match it bit for bit.
    """
    neg_lr = _f32(-_lr(t.lr))  # torch's fused SGD: its double -lr rounded to fp32
    check_remainders("sgd_step", t)
    take_sources("sgd_step", t, [s.momentum_buffers] if h.momentum != 0 else [])
    for i in range(len(t.params)):
        g = _effective_grad(t, i, h.maximize)
        p32 = _master(t, i)
        if h.weight_decay != 0:
            g = _fma(p32, h.weight_decay, g)
        writes = []
        if h.momentum != 0:
            buf = s.momentum_buffers[i]
            first = t.steps[i] == 1
            new_buf = torch.where(first, g, _fma(g, 1 - h.dampening, buf * h.momentum))
            writes.append((buf, new_buf))
            g = _fma(new_buf, h.momentum, g) if h.nesterov else new_buf
        writes += _param_writes(t, i, _fma(g, neg_lr, p32))
        _commit(t.found_inf, writes)


def adam_step(t: StepTensors, s: AdamStates, h: AdamHyper) -> None:
    """torch.optim.Adam (``h.decoupled`` False) / AdamW (True).

    A non-empty ``s.max_exp_avg_sqs`` turns on amsgrad: the running maximum of ``exp_avg_sq``
    is updated and the denominator uses it, as torch's ``amsgrad=True``.

    The order of operations is torch's fused CPU kernel's (so fp32 params match
    ``torch.optim.Adam(W)(fused=True)`` bit for bit): the bias corrections, the step size and
    the decoupled decay factor in float64, rounded to fp32 once; ``exp_avg`` by ``lerp``;
    ``exp_avg_sq`` and coupled weight decay by fused multiply-adds; two divides.
    """
    lr = _lr(t.lr)
    beta1, beta2 = h.beta1, h.beta2
    check_remainders("adam_step", t)
    take_sources("adam_step", t, [x for x in s if x])
    for i in range(len(t.params)):
        g = _effective_grad(t, i, h.maximize)
        p32 = _master(t, i)
        step = t.steps[i].double()
        if h.weight_decay != 0:
            if h.decoupled:
                p32 = p32 * _f32(1 - lr * h.weight_decay)
            else:
                g = _fma(p32, h.weight_decay, g)
        m = torch.lerp(s.exp_avgs[i], g, 1 - beta1)
        v = _fma(g * (1 - beta2), g, s.exp_avg_sqs[i] * beta2)
        writes = [(s.exp_avgs[i], m), (s.exp_avg_sqs[i], v)]
        if s.max_exp_avg_sqs:
            v = torch.maximum(s.max_exp_avg_sqs[i], v)
            writes.append((s.max_exp_avg_sqs[i], v))
        neg_step_size = _f32(-lr / (1 - beta1**step))
        bias_correction2_sqrt = _f32(torch.sqrt(1 - beta2**step))
        denom = _sqrt(v) / bias_correction2_sqrt + h.eps
        writes += _param_writes(t, i, p32 + (neg_step_size * m) / denom)
        _commit(t.found_inf, writes)


def lion_step(t: StepTensors, s: LionStates, h: LionHyper) -> None:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), decoupled decay,
    as lucidrains/lion-pytorch computes it with torch ops (its ``add(alpha=)`` is one fused
    multiply-add on the CPU): the sign uses the old ``exp_avg``, which is updated afterwards.

    ``t.steps`` is unused by the math (Lion has no bias correction): every step op takes the
    same :class:`~fused_accum.ops.StepTensors`.
    """
    lr = _lr(t.lr)
    # lucidrains' ops with a Python float lr: add_(alpha=-lr) rounds lr to fp32, the decay
    # factor 1 - lr * weight_decay is formed in double
    lr32, decay = _f32(lr), _f32(1 - lr * h.weight_decay)
    check_remainders("lion_step", t)
    take_sources("lion_step", t, [s.exp_avgs])
    for i in range(len(t.params)):
        g = _effective_grad(t, i, h.maximize)
        p32 = _master(t, i) * decay
        m = s.exp_avgs[i]
        direction = torch.sign(_fma(g, 1 - h.beta1, m * h.beta1))
        new_p = p32 - lr32 * direction  # direction is -1, 0 or 1: the product is exact
        new_m = _fma(g, 1 - h.beta2, m * h.beta2)
        _commit(t.found_inf, [(m, new_m), *_param_writes(t, i, new_p)])


def adagrad_step(t: StepTensors, s: AdagradStates, h: AdagradHyper) -> None:
    """torch.optim.Adagrad: ``sum += g * g`` (after coupled weight decay), ``p -= clr * g /
    (sqrt(sum) + eps)`` with ``clr = lr / (1 + (step - 1) * lr_decay)``. ``s.sums`` start at
    ``initial_accumulator_value`` (the optimizer fills them: the record's ``State`` init).

    The order of operations is torch's fused CPU kernel's (so fp32 params match
    ``torch.optim.Adagrad(fused=True)`` bit for bit): clr in double, rounded to fp32 once; weight
    decay and the sum each one fused multiply-add; clr times g, then one divide.
    """
    lr = _lr(t.lr)
    check_remainders("adagrad_step", t)
    take_sources("adagrad_step", t, [s.sums])
    for i in range(len(t.params)):
        g = _effective_grad(t, i, h.maximize)
        p32 = _master(t, i)
        clr = _f32(lr / (1 + (t.steps[i].double() - 1) * h.lr_decay))
        if h.weight_decay != 0:
            g = _fma(p32, h.weight_decay, g)
        total = _fma(g, g, s.sums[i])
        std = _sqrt(total) + h.eps
        _commit(t.found_inf, [(s.sums[i], total), *_param_writes(t, i, p32 - (clr * g) / std)])


def ademamix_step(t: StepTensors, s: AdemamixStates, h: AdEMAMixHyper) -> None:
    """AdEMAMix (Pagliardini, Ablin and Grangier 2024, "The AdEMAMix Optimizer: Better, Faster,
    Older") with AdamW's decoupled weight decay, as pytorch-optimizer 4.1.0's
    ``AdEMAMix(weight_decouple=True)`` computes it with torch ops::

        p *= 1 - lr * wd;  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g;
        m_slow = lerp(m_slow, g, 1 - beta3_t)
        p += -lr * (m / (1 - beta1**step) + alpha_t * m_slow) / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    with, over T = ``t_alpha_beta3`` steps (alpha and beta3 themselves without it),
    ``alpha_t = min(step * alpha / T, alpha)`` and ``beta3_t = min(exp(ln(beta1) * ln(beta3) /
    ((1 - step / T) * ln(beta3) + (step / T) * ln(beta1))), beta3)``.

    The per-tensor scalars in double, each rounded to fp32 once where the peer's op takes its
    Python float (-lr, the decay factor, 1 / the bias corrections' divisors, alpha_t, 1 -
    beta3_t); ``v``'s update one fused multiply-add as torch's ``addcmul_``, ``alpha_t *
    m_slow`` one as its ``add_(alpha=)``; the square root correctly rounded, where torch's fp32
    CPU ``sqrt`` is not (:func:`_sqrt`): so fp32 params step bit for bit as the peer's with a
    correctly rounded sqrt (tests/test_kernels.py). The exp of the warm-up is torch's in double,
    which differs from Python's ``math.exp`` in the last bit for ~5% of arguments (measured):
    it moves the fp32 ``1 - beta3_t`` in about one step of 10^5.
    """
    lr = _lr(t.lr)
    neg_lr, decay = _f32(-lr), _f32(1 - lr * h.weight_decay)
    check_remainders("ademamix_step", t)
    take_sources("ademamix_step", t, [s.exp_avgs, s.exp_avg_sqs, s.exp_avg_slows])
    for i in range(len(t.params)):
        g = _effective_grad(t, i, h.maximize)
        p32 = _master(t, i)
        step = t.steps[i].double()
        alpha, beta3 = _ademamix_warmup(step, h)
        if h.weight_decay != 0:
            p32 = p32 * decay
        m = torch.lerp(s.exp_avgs[i], g, 1 - h.beta1)
        v = _fma(g * (1 - h.beta2), g, s.exp_avg_sqs[i] * h.beta2)
        slow = _lerp(s.exp_avg_slows[i], g, _f32(1 - beta3))
        denom = _sqrt(v) / _f32(torch.sqrt(1 - h.beta2**step)) + h.eps
        update = _fma(slow, _f32(alpha), m / _f32(1 - h.beta1**step))
        new_p = p32 + (neg_lr * update) / denom
        writes = [(s.exp_avgs[i], m), (s.exp_avg_sqs[i], v), (s.exp_avg_slows[i], slow)]
        _commit(t.found_inf, [*writes, *_param_writes(t, i, new_p)])


def _ademamix_warmup(step: Tensor, h: AdEMAMixHyper) -> Tuple[Tensor, Tensor]:
    """(alpha_t, beta3_t) at ``step`` (a float64 tensor), in double, as pytorch-optimizer's
    schedule_alpha and schedule_beta3 compute them in Python floats."""
    if h.t_alpha_beta3 is None:
        return step * 0 + h.alpha, step * 0 + h.beta3
    ratio = step / h.t_alpha_beta3
    alpha = torch.clamp(step * h.alpha / h.t_alpha_beta3, max=h.alpha)
    log_beta1, log_beta3 = math.log(h.beta1), math.log(h.beta3)
    beta3 = torch.exp(log_beta1 * log_beta3 / ((1.0 - ratio) * log_beta3 + ratio * log_beta1))
    return alpha, torch.clamp(beta3, max=h.beta3)


def _lerp(a: Tensor, b: Tensor, w: Tensor) -> Tensor:
    """``torch.lerp(a, b, w)`` for a per-tensor fp32 weight ``w`` (0-dim): from the nearer end,
    one fused multiply-add (test_reference_primitives_round_as_torch_fused_kernels checks the
    formula)."""
    d = b - a
    return torch.where(w.abs() < 0.5, _fma(d, w, a), _fma(d, w - 1, b))


# --- a split step's elementwise ops (fused_accum.ops.SplitStep: prologue, middle, epilogue) ---


def muon_prologue(t: StepTensors, s, h) -> None:
    """torch.optim.Muon's start, in its ops: the momentum buffer lerped towards the gradient by
    ``1 - momentum``; the update (the new buffer, or with ``nesterov`` the gradient lerped
    towards it by ``momentum``) into ``s.updates[i]``, the weight's shape, for the middle. It
    reads and writes no parameter; a skipped step (``found_inf``) writes neither list."""
    check_remainders("muon_prologue", t)
    if t.sources:  # (offload's out-of-place step: refused for split steps, registry.check_whole_tensors)
        raise ValueError("muon_prologue: sources are not supported by a split step")
    for i in range(len(t.params)):
        g = _effective_grad(t, i, maximize=False)
        new_buf = torch.lerp(s.momentum_buffers[i], g, 1 - h.momentum)
        update = torch.lerp(g, new_buf, h.momentum) if h.nesterov else new_buf
        _commit(t.found_inf, [(s.momentum_buffers[i], new_buf), (s.updates[i], update)])


def muon_epilogue(t: StepTensors, s, h) -> None:
    """torch.optim.Muon's end, in its order: ``p * (1 - lr * weight_decay)``, then ``+ (-lr *
    ratio) * update`` (the middle's ``s.updates[i]``) in one fused multiply-add (torch's
    ``add_(alpha=)``), each factor formed in double and rounded to fp32; ``ratio`` of the (rows,
    columns) shape: sqrt(max(1, rows / columns)), or 0.2 sqrt(max(rows, columns)) with
    ``match_rms_adamw``. ``s.updates`` are matrices of any float dtype and strides (the middle's
    bf16, transposed where the matrix is tall); the window's gradient is not read."""
    lr = _lr(t.lr)
    decay = _f32(1 - lr * h.weight_decay)
    check_remainders("muon_epilogue", t)
    for i in range(len(t.params)):
        if s.updates[i].dim() != 2:
            raise ValueError(
                f"muon_epilogue: updates[{i}] must be a matrix (2-D), got shape {tuple(s.updates[i].shape)}"
            )
        rows, columns = s.updates[i].shape
        ratio = 0.2 * math.sqrt(max(rows, columns)) if h.match_rms_adamw else math.sqrt(max(1, rows / columns))
        new_p = _fma(s.updates[i].reshape(-1).float(), _f32(-(lr * ratio)), _master(t, i) * decay)
        _commit(t.found_inf, _param_writes(t, i, new_p))

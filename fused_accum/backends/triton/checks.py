"""What the triton backend's ops accept: the argument checks, and contiguous copies of the rare
operands the kernels cannot read through an address.

The kernels reach every tensor through a raw address in a table, so nothing checks an argument
once it is in one: these checks run before a launch plan is built (a plan-cache miss, or a
caller plan's first call), and a hit relies on what they established (see the package's
``__init__``). Each per-tensor check first runs over whole lists, one C call per tensor, and only
when that fails tensor by tensor, for the message: the loop costs ~10 us per tensor.
"""

from __future__ import annotations

import os
import operator
from typing import List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .. import reference

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Triton decides at decoration time, when the kernels module was imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_numel = Tensor.numel
_is_contiguous = Tensor.is_contiguous
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def device_of(t: Tensor) -> torch.device:
    device = t.device
    if INTERPRETED and device.type != "cpu":
        # the interpreter copies tensor arguments to the host, but not the tensors that the
        # tables address: it would dereference device addresses on the CPU
        raise RuntimeError(f"under TRITON_INTERPRET=1 the triton backend runs on CPU tensors only, got {device}")
    return device


def _check_acc(name: str, i: int, t: Tensor, device: torch.device) -> None:
    if t.dtype != torch.float32 or t.dim() != 1 or t.stride(0) != 1 or t.device != device:
        raise ValueError(
            f"{name}[{i}] must be a 1-D contiguous float32 tensor on {device}, "
            f"got {t.dtype} shape {tuple(t.shape)} stride {t.stride()} on {t.device}"
        )


def _check_state(name: str, i: int, t: Tensor, numel: int, device: torch.device) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel or t.device != device:
        raise ValueError(
            f"{name}[{i}] must be a contiguous float32 tensor of {numel} elements on {device} like accs[{i}], "
            f"got {t.dtype} shape {tuple(t.shape)} stride {t.stride()} on {t.device}"
        )


def _check_same(name: str, i: int, t: Tensor, numel: int, device: torch.device) -> None:
    if t.numel() != numel or t.device != device:
        raise ValueError(
            f"{name}[{i}] must have {numel} elements on {device} like accs[{i}], got {t.numel()} on {t.device}"
        )


def _check_dtype(name: str, i: int, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}[{i}] must be bfloat16, float16 or float32, got {t.dtype}")


def check_dtypes(name: str, xs: Sequence[Tensor], dtypes: tuple) -> None:
    """``dtypes`` (those of ``xs``, already read) are all floats the kernels take."""
    if not set(dtypes) <= set(FLOAT_DTYPES):
        for i, x in enumerate(xs):
            _check_dtype(name, i, x)


def check_scalar(name: str, t: Optional[Tensor], device: torch.device) -> None:
    if t is not None and (t.dtype != torch.float32 or t.numel() != 1 or t.device != device):
        raise ValueError(
            f"{name} must be a one-element float32 tensor on {device}, "
            f"got {t.dtype} with {t.numel()} elements on {t.device}"
        )


# --- accumulate ----------------------------------------------------------------------------------


def accumulate_is_simple(acc: Tensor, offsets: Tensor, grads: List[Tensor]) -> bool:
    """The cheap checks of every accumulate call (a few attributes of two tensors); when they
    fail, reference.slice_starts says why, or there is nothing to do (no gradients)."""
    return not (
        acc.dtype != torch.float32
        or acc.dim() != 1
        or not acc.is_contiguous()
        or offsets.dtype != torch.int64
        or offsets.dim() != 1
        or offsets.device.type != "cpu"
        or len(offsets) != len(grads)
        or not grads
    )


def slice_starts(acc: Tensor, offsets: Tensor, grads: List[Tensor], numels: tuple) -> np.ndarray:
    """reference.slice_starts's checks over whole columns (it loops in Python: ~45 us per tensor
    here, most of a miss); on a failure the reference runs, to raise its message."""
    starts = offsets.numpy()
    sizes = np.asarray(numels, dtype=np.int64)
    # fits before ends are formed: start + numel could wrap int64 (a huge offset), this cannot
    if starts[0] >= 0 and bool((sizes <= acc.numel() - starts).all()):
        ends = starts + sizes
        if bool((starts[1:] >= ends[:-1]).all()) and set(map(_device, grads)) == {acc.device}:
            return starts
    return np.asarray(reference.slice_starts(acc, offsets, grads), dtype=np.int64)


# --- steps ---------------------------------------------------------------------------------------


def step_lengths(name: str, params, states: dict, accs, lp_params, grads, remainders=()) -> None:
    """Every list as long as params (lp_params, grads and remainders: or empty; remainders and
    lp_params not both)."""
    n = len(params)
    if remainders and (len(remainders) != n or lp_params):
        _remainder_refusal(name, params, remainders, lp_params)
    for what, xs in [("accs", accs), *states.items()]:
        if len(xs) != n:
            raise ValueError(f"{name}: {what} must be as long as params ({n}), got {len(xs)}")
    if lp_params and len(lp_params) != n:
        raise ValueError(f"{name}: lp_params must be empty or as long as params ({n}), got {len(lp_params)}")
    if grads and len(grads) != n:
        raise ValueError(f"{name}: grads must be empty or as long as params ({n}), got {len(grads)}")


def step_scalars(
    name: str,
    n: int,
    steps: Optional[Tensor],
    lr: Tensor,
    coef: Tensor,
    found_inf: Optional[Tensor],
    device: torch.device,
) -> None:
    """lr, coef, found_inf and steps: the device values a step reads (never the host)."""
    if lr.dtype not in (torch.float64, torch.float32) or lr.numel() != 1 or lr.device != device:
        raise ValueError(
            f"lr must be a one-element float64 or float32 tensor on {device}, "
            f"got {lr.dtype} with {lr.numel()} elements on {lr.device}"
        )
    check_scalar("coef", coef, device)
    check_scalar("found_inf", found_inf, device)
    # exactly one step count per tensor, as the C++ binding requires (a longer tensor would
    # mean the caller's lists and counts are out of step)
    if steps is not None and (
        steps.dtype != torch.float32 or steps.dim() != 1 or steps.numel() != n or steps.device != device
    ):
        raise ValueError(
            f"{name}: steps must be a 1-D float32 tensor of {n} step counts (one per param) on "
            f"{device}, got {steps.dtype} of shape {tuple(steps.shape)} on {steps.device}"
        )


class _Remainders:
    """What reference.check_remainders reads of a step's records."""

    def __init__(self, params, remainders, lp_params):
        self.params, self.remainders, self.lp_params = params, remainders, lp_params


def _remainder_refusal(name, params, remainders, lp_params) -> None:
    reference.check_remainders(name, _Remainders(params, remainders, lp_params))


def check_remainders(name: str, params, remainders, lp_params, device: torch.device) -> None:
    """reference.check_remainders (its messages), over whole lists first: bf16 params, int16
    remainders of their sizes, on the device."""
    ok = (
        len(remainders) == len(params)
        and not lp_params
        and set(map(_dtype, params)) == {torch.bfloat16}
        and set(map(_dtype, remainders)) == {torch.int16}
        and tuple(map(_numel, remainders)) == tuple(map(_numel, params))
        and set(map(_device, remainders)) == {device}
    )
    if not ok:
        _remainder_refusal(name, params, remainders, lp_params)


def validate_step(name, params, states, accs, lp_params, grads, device, remainders=()) -> None:
    """Every per-tensor check of a step (when its launch plan is built, see the package)."""
    if remainders:
        check_remainders(name, params, remainders, lp_params, device)
    numels = tuple(map(_numel, accs))
    fp32_lists = [accs, *states.values()]
    float_lists = [xs for xs in (params, lp_params, grads) if xs]
    ok = (
        set(map(Tensor.dim, accs)) == {1}
        and all(
            set(map(_dtype, xs)) == {torch.float32}
            and all(map(_is_contiguous, xs))
            and tuple(map(_numel, xs)) == numels
            for xs in fp32_lists
        )
        and all(set(map(_dtype, xs)) <= set(FLOAT_DTYPES) and tuple(map(_numel, xs)) == numels for xs in float_lists)
        and all(set(map(_device, xs)) == {device} for xs in fp32_lists + float_lists)
    )
    if ok:
        return
    for i in range(len(params)):
        numel = accs[i].numel()
        _check_acc("accs", i, accs[i], device)
        _check_same("params", i, params[i], numel, device)
        _check_dtype("params", i, params[i])
        for what, xs in states.items():  # (any shape: a split step's prologue writes matrices)
            _check_state(what, i, xs[i], numel, device)
        if lp_params:
            _check_same("lp_params", i, lp_params[i], numel, device)
            _check_dtype("lp_params", i, lp_params[i])
        if grads:
            _check_same("grads", i, grads[i], numel, device)
            _check_dtype("grads", i, grads[i])


# --- contiguous copies ---------------------------------------------------------------------------


def all_contiguous(*lists: Sequence[Tensor]) -> bool:
    return all(all(map(_is_contiguous, xs)) for xs in lists)


def readable(ts: Sequence[Tensor], keep: list) -> Sequence[Tensor]:
    """``ts``, each non-contiguous one replaced by a contiguous copy, for reading through an
    address. Non-contiguous gradients are rare (autograd gives a parameter's gradient the
    parameter's layout), so a copy here costs less than a strided path in every kernel. The
    copies go into ``keep``: alive until the launch has been queued."""
    if all(map(_is_contiguous, ts)):
        return ts
    out = []
    for t in ts:
        if not t.is_contiguous():
            t = t.contiguous()
            keep.append(t)
        out.append(t)
    return out


def writable(ts: Sequence[Tensor], write_back: list) -> Sequence[Tensor]:
    """Like readable, for tensors the kernel writes: each copy is paired with its original in
    ``write_back``, to be copied back after the launch (a channels_last parameter, say). The
    optimizer's own buffers are always contiguous."""
    if all(map(_is_contiguous, ts)):
        return ts
    out = []
    for t in ts:
        if not t.is_contiguous():
            c = t.contiguous()
            write_back.append((t, c))
            t = c
        out.append(t)
    return out


def matrix_rows(op: str, name: str, xs: Sequence[Tensor]) -> tuple:
    """The rows of each of ``xs``, which must be matrices (an update whose scalars take the shape
    of its first list, ``name``: kernels.Update.shaped)."""
    for i, x in enumerate(xs):
        if x.dim() != 2:
            raise ValueError(f"{op}: {name}[{i}] must be a matrix (2-D), got shape {tuple(x.shape)}")
    return tuple(x.shape[0] for x in xs)

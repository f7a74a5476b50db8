"""The bits of the parameter formats, as every backend writes them (the reference's helpers,
:mod:`fused_accum.backends.reference`, and the masters' mode, :mod:`fused_accum.masters`, use
them): the exact 2-byte master (a bf16 weight and an int16 remainder, csrc/math.h's
``split_master``/``rebuild_master``), rounding to a 16-bit dtype and widening from one with
one NaN pattern each, and the fp32 master following a low-precision weight written from outside.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


# --- exact 2-byte masters: the bf16 weight plus an int16 remainder (issue 28) ----------------

_OVERFLOWING = 0x7F7F8000  # fp32 magnitudes from here up to inf round to inf in bf16
_INF = 0x7F800000  # the magnitude of fp32 inf


def split_master(master: Tensor) -> Tuple[Tensor, Tensor]:
    """``(weight, remainder)`` of the fp32 ``master``: a bf16 tensor and an int16 tensor of its
    shape. The same map as csrc/math.h's ``split_master`` (which the C++ and CUDA kernels use;
    csrc/tests/test_math.cpp checks it on all 2**32 patterns), and the Triton kernels'
    ``_split_master``. On the magnitude ``m`` of the master's bits (the sign bit is the
    weight's):

    - ``m < 0x7F7F8000`` (every finite master below 3.3961e38): ``weight = (m + 0x8000) >> 16``,
      the nearest bf16, **ties away from zero** (no 16-bit remainder can be exact and keep
      torch's round-to-nearest-even: an even bf16 value has 65,537 fp32 preimages), so
      ``weight == master.to(torch.bfloat16)`` except at exact ties (low half 0x8000, one fp32
      value per bf16 step: ~2**-16 of uniformly random bits), where the weight is the neighbour
      farther from zero; ``remainder = m - (weight << 16)``, in [-32768, 32767] (negative: the
      master is below the weight's magnitude). :func:`rebuild_master` gives the master back
      bit for bit.
    - ``0x7F7F8000 <= m <= 0x7F800000`` (finite masters that round to inf in bf16, and inf):
      ``(+-inf, 0)``: they become +-inf, as ``master.to(torch.bfloat16)`` would show them.
    - ``m > 0x7F800000`` (NaN): ``(+-NaN, 0)``, the bf16 pattern 0x7FC0 with the sign: a NaN
      stays a NaN (its payload is not kept).

    So a weight is finite exactly when its master is finite and below 3.3961e38, NaN exactly
    when its master is NaN.
    """
    if master.dtype != torch.float32:
        raise ValueError(f"split_master: master must be float32, got {master.dtype}")
    u = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (u >> 16) & 0x8000
    m = u & 0x7FFFFFFF
    w = (m + 0x8000) >> 16
    r = m - (w << 16)
    shown_inf = m >= _OVERFLOWING  # and NaN, below
    w = torch.where(m > _INF, 0x7FC0, torch.where(shown_inf, 0x7F80, w))
    r = torch.where(shown_inf, 0, r)
    bits = sign | w  # 0..0xFFFF: as int16, the patterns from 0x8000 up are negative
    weight = (bits - (bits >= 0x8000).long() * 0x10000).to(torch.int16).view(torch.bfloat16)
    return weight.view(master.shape), r.to(torch.int16).view(master.shape)


def rebuild_master(weight: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master of the bf16 ``weight`` and the int16 ``remainder`` (same shape), for any
    pair, on ``W``, the weight's magnitude bits, and ``r``, the remainder:

    - ``W == 0`` and ``r < 0``: +-0.0 (the weight itself);
    - ``W == 0x7F80`` (inf) and ``r != 0``: +-inf (the weight itself);
    - otherwise ``sign | ((W << 16) + r)`` (a NaN weight with any remainder gives a NaN).

    It inverts :func:`split_master` on every finite master below 3.3961e38. Every pair rebuilds
    to a master that rounds to its weight under the tie rule (``split_master`` of it gives the
    weight back; a NaN weight may come back as the canonical NaN), within half a bf16 ulp of it:
    the remainder a weight written from outside the optimizer keeps (``w.data[mask] = 0``,
    a broadcast) moves the master by less than half an ulp of the new weight, never to a huge
    value or a NaN. csrc/tests/test_math.cpp checks this on all 2**32 pairs.
    """
    if weight.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise ValueError(
            f"rebuild_master: weight must be bfloat16 and remainder int16, got {weight.dtype} and {remainder.dtype}"
        )
    wb = weight.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    r = remainder.reshape(weight.shape).to(torch.int64)
    sign = (wb & 0x8000) << 16
    w = wb & 0x7FFF
    keep = ((w == 0) & (r < 0)) | ((w == _INF >> 16) & (r != 0))  # the weight itself
    u = sign | torch.where(keep, w << 16, (w << 16) + r)
    u = u - (u >= 2**31).long() * 2**32  # as int32
    return u.to(torch.int32).view(torch.float32).view(weight.shape)


_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` rounded to ``dtype`` as the steps write it: to nearest even, ``x.to(dtype)``, with
    one pattern per NaN: 0x7FC0 in bf16 (csrc/cpu/convert.h's, the Triton kernels' _round;
    torch's own ``.to(torch.bfloat16)`` writes 0xFFFF or 0x7FC0 depending on the layout: its
    vectorised loop makes another NaN than its scalar one), the sign and 0x7E00 in fp16. (The
    CUDA kernels' conversions make the NaN 0x7FFF, as torch's on a GPU.)"""
    if x.dtype == dtype or dtype not in (torch.bfloat16, torch.float16):
        return x.to(dtype)
    if dtype == torch.bfloat16:
        u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        bits = torch.where(torch.isnan(x.reshape(u.shape)), 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        return (bits - (bits >= 0x8000).long() * 0x10000).to(torch.int16).view(torch.bfloat16).view(x.shape)
    nan = torch.tensor(float("nan"), dtype=torch.float16, device=x.device)  # 0x7E00
    return torch.where(torch.isnan(x), torch.where(torch.signbit(x), -nan, nan), x.to(torch.float16))


def widened(lp: Tensor) -> Tensor:
    """A bf16/fp16 tensor's exact fp32 values, flattened, a NaN's payload kept (the bits moved
    into place, as every kernel widens them: torch's own fp16 ``.float()`` makes 0x7FFFFFFF or
    0x7FC00000 of the NaN 0x7E00 depending on the layout)."""
    lp = lp.reshape(-1).contiguous()
    if lp.dtype not in (torch.bfloat16, torch.float16):
        return lp.float()
    h = lp.view(torch.int16).to(torch.int64) & 0xFFFF
    if lp.dtype == torch.bfloat16:
        u = h << 16
    else:  # fp16: the NaNs by hand (exponent 31 to 255, the payload shifted into place)
        nan_bits = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
        u = torch.where(torch.isnan(lp), nan_bits, _bits_of(lp.float()))
    return (u - (u >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)


def _bits_of(x: Tensor) -> Tensor:
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def follow_weight(master: Tensor, lp: Tensor) -> Tensor:
    """The fp32 master a step updates when it has low-precision params: ``float(lp)`` where the
    bits of ``lp`` differ from the bits of ``master`` rounded to lp's dtype as the step writes
    lp (:func:`rounded`: to nearest even), else ``master`` itself (the reference's module
    docstring: "Masters follow the weight"). ``master``: 1-D fp32, ``lp``: as many elements, any float
    dtype. csrc/math.h's ``follow_weight`` and the Triton kernels' ``_follow_weight`` are the
    same rule."""
    lp = lp.reshape(-1).contiguous()
    ints = _INT_OF_SIZE[lp.element_size()]
    differ = rounded(master, lp.dtype).view(ints) != lp.view(ints)
    return torch.where(differ, widened(lp), master)

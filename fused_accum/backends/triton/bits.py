"""The bit-level rules the Triton kernels share (fused_accum.backends.triton.kernels): rounding to
bf16 as torch does, following a weight written from outside (reference.follow_weight), the exact
2-byte master's split and rebuild (reference.split_master / rebuild_master), whole powers, and
the fp64 a launcher passes as bits. Each is the reference's rule, bit for bit, as csrc/math.h's is.
"""

import struct

import triton
import triton.language as tl


@triton.jit
def _follow_weight(master, lp, LP_DTYPE: tl.constexpr):
    """reference.follow_weight (csrc/math.h's): ``float(lp)`` where lp's bits differ from the
    bits of ``master`` rounded to LP_DTYPE as the step writes lp (_round), else ``master``. The
    bits are compared as integers, so a NaN master whose rounding is the stored NaN is kept
    and -0.0 against +0.0 differs; the select is of bits too, so a NaN's payload is kept."""
    if LP_DTYPE == tl.float32:
        return lp  # the rounding is the master itself: lp's bits either way
    else:
        differ = _round(master, LP_DTYPE).to(tl.int16, bitcast=True) != lp.to(tl.int16, bitcast=True)
        wide = lp.to(tl.float32).to(tl.uint32, bitcast=True)
        return tl.where(differ, wide, master.to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)


# Exact 2-byte masters (issue 28): reference.split_master / rebuild_master (and csrc/math.h's),
# on the two 16-bit halves of the master's bits, in uint32 arithmetic. The remainder is the low
# half read as a signed number; the weight's magnitude is the high half's plus one where the low
# half is >= 0x8000 (nearest, ties away from zero). Finite masters that round to inf (rounding
# up from 0x7F7F), and inf, split as (+-inf, 0); NaNs as (+-0x7FC0, 0). The rebuild gives the
# weight itself for (+-0, r < 0) and (+-inf, r != 0), so every pair rebuilds to a master that
# rounds to its weight. Integer selects only: the same code compiled and interpreted.


@triton.jit
def _split_master(x):
    """(bf16 weight, int16 remainder) of the fp32 ``x``, bit for bit split_master's."""
    u = x.to(tl.uint32, bitcast=True)
    high = u >> 16
    low = u & 0xFFFF
    up = low >= 0x8000
    h = high & 0x7FFF
    w = h + up.to(tl.uint32)  # 0x7F80 (inf) where a finite master rounds up from 0x7F7F
    nan = (h > 0x7F80) | ((h == 0x7F80) & (low != 0))
    w = tl.where(nan, 0x7FC0, w)
    low = tl.where(nan | (up & (h == 0x7F7F)), 0, low)
    weight = ((high & 0x8000) | w).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return weight, low.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _rebuild_master(weight, remainder):
    """The fp32 master of the bf16 ``weight`` and int16 ``remainder``, rebuild_master's."""
    wb = weight.to(tl.uint16, bitcast=True).to(tl.uint32)
    low = remainder.to(tl.uint16, bitcast=True).to(tl.uint32)
    negative = low >= 0x8000
    w0 = wb & 0x7FFF
    keep = (negative & (w0 == 0)) | ((w0 == 0x7F80) & (low != 0))  # the weight itself
    high = (wb & 0x8000) | (w0 - negative.to(tl.uint32))  # (w << 16) + remainder, on the halves
    bits = tl.where(keep, wb << 16, (high << 16) | low)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 x rounded to nearest-even in DTYPE, bit for bit as torch's ``.to(DTYPE)``.

    bf16 is rounded by hand (torch's own integer recipe, NaN -> 0x7FC0) rather than by
    ``.to``: the compiled ``.to`` rounds to nearest-even, but the interpreter's truncates
    (triton 3.9), and the interpreter is where the kernels are tested. A handful of integer ops
    per element costs nothing in a bandwidth-bound kernel.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        bits = tl.where(x == x, bits, 0x7FC0)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _pow_whole(base, n):
    """base ** n for a whole number n >= 0 stored as fp32 (a step count), by squaring, in the
    precision of ``base`` (fp32 or fp64).

    Exact for n = 1 (as pow is), within ~log2(n) roundings otherwise. Computing it as
    exp2(n*log2(base)) instead would err by ~2 ulp even at n = 1, and 1 - beta2**n divides that
    error by 1 - beta2 (1e-3): 2.4e-4 relative in Adam's bias correction on the first steps.
    """
    result = base * 0.0 + 1.0
    square = base
    e = n.to(tl.int32)
    while e > 0:
        result = tl.where((e & 1) != 0, result * square, result)
        square = square * square
        e = e >> 1
    return result


# The doubles a step's update reads (betas, weight decay: torch forms the per-tensor scalars in
# double from them) travel in the update's tuple of scalars, as two int64s each. Triton passes a
# Python float as fp32, and specialises an int inside a tuple on its value (equal to 1,
# divisible by 16, fits int32: triton 3.9's argument specialisation ignores do_not_specialize
# there), which would compile a variant per value (issue 10 item 8). So each half of the bits is
# sent as an odd int64 above 2**40: of one type, never 1, never divisible by 16.
_MARK = 1 << 40


def packed_double(x: float) -> tuple:
    """``x`` as the two int64s :func:`_double` takes (the host side)."""
    bits = struct.unpack("<Q", struct.pack("<d", float(x)))[0]
    return _MARK | (bits >> 32) << 1 | 1, _MARK | (bits & 0xFFFFFFFF) << 1 | 1


_UNMARK = tl.constexpr(_MARK + 1)  # (an int64 constant: no mask whose type Triton could narrow)


@triton.jit
def _double(high, low):
    """The fp64 that :func:`packed_double` sent as ``(high, low)``, every bit of it."""
    bits = ((high - _UNMARK) >> 1) << 32 | ((low - _UNMARK) >> 1)
    return bits.to(tl.float64, bitcast=True)

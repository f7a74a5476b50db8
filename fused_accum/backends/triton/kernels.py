"""The Triton kernels of the ``triton`` backend: the math, and only the math.

Every formula here follows :mod:`fused_accum.backends.reference` (the specification) term by
term, in the same order and with the same fused multiply-adds (``tl.fma`` where the reference
has one; the launcher turns automatic contraction off), so on the same inputs the kernels round
where the reference rounds. The tables are laid out in :mod:`.tables` and the kernels launched
from :mod:`fused_accum.backends.triton` (the package's ``__init__``).

How a launch finds its data (multi-tensor: one launch for any number of tensors):

- the *tensor table* is an ``int64 [n_tensors, ROW]`` array, one row per tensor, holding its
  element count, its position in the op's lists (to index ``steps``), whether its addresses are
  ALIGNED (below) and the raw addresses of the tensors it touches (acc, grad, param, low-precision
  param, optimizer state); an absent tensor has address 0 and is never dereferenced (its code
  is compiled out by a constexpr);
- the *chunk table* is an ``int64 [n_chunks, 2]`` array of (tensor row, first element): one
  program per chunk of at most ``chunk`` elements of one tensor, walked in ``BLOCK`` steps.
  ``chunk`` is a run-time argument (a power of two, a multiple of BLOCK) that the launcher sizes
  so the grid has enough programs for the GPU (issue 10, item 4), without a recompile.

Offsets are int64 throughout (loaded from the tables), so tensors of more than 2**31 elements
are addressed correctly. A kernel is specialised (constexpr) on the dtypes of the tensors it
reaches through raw addresses: the launcher groups tensors by dtype, one launch per group.
Nothing else is specialised: every pointer and integer argument is declared
``do_not_specialize``/``do_not_specialize_on_alignment`` (``_NO_SPECIALIZE``), so a chunk table
at an odd offset or a ``found_inf`` that is a view into a stats buffer compiles no new variant
(the old launcher compiled 20 accumulate variants for 8 configurations; each compile is a
mid-training stall and cannot happen during CUDA-graph capture).

Vector width. An address loaded from a table tells the compiler nothing about alignment, so
by default every access is a scalar one (in the PTX: ``ld.global.b16``/``b32``). A row whose
addresses are all multiples of VEC elements is marked ALIGNED by the launcher; each kernel
branches on that flag (uniform per program) into a copy of its body compiled with
``tl.multiple_of`` hints, where each thread moves VEC = 4 elements per access: 16 bytes of
fp32, 8 of bf16/fp16 (``ld.global.v4.b32``, ``v2.b32``). The size does not have to be a
multiple of VEC: an aligned row's body (its first ``numel - numel % VEC`` elements) is walked
vectorised and the last 1-3 elements by a scalar tail (a 50,257-element bias is 50,256 vector
elements and 1 scalar one, not 50,257 scalar ones). Branching inside the kernel rather than
launching aligned and unaligned rows apart keeps one launch per dtype whatever the mix.
The unaligned branch walks blocks of BLOCK // VEC: a scalar access needs a 64-bit address per
element per tensor, so at BLOCK = 1024 (8 elements per thread) the unaligned fused-AdamW body
took 164 registers (ptxas, sm_90), and a kernel gets the registers of its hungrier branch:
156 for the whole kernel, 3 programs per SM. At 256 it takes 40, under the aligned body's 70.
VEC = 8 would make the 16-bit accesses 16 bytes too, but then fp32 and 16-bit tensors get
different register layouts and the compiler converts between them through shared memory (5
shared-memory ops and a barrier per block in the PTX); 4 keeps a single layout. So the exact
2-byte master (HAS_REM: bf16 param + int16 remainder, issue 28) is two 8-byte accesses per 4
elements, the 16 bytes the fp32 master's one access moves, in the same layout.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import triton
import triton.language as tl

from .bits import _follow_weight, _rebuild_master, _round, _split_master

# Columns of the tensor table; the launcher writes rows in this order.
NUMEL = tl.constexpr(0)  # elements of this tensor
INDEX = tl.constexpr(1)  # its position in the op's lists (the entry of ``steps``)
IS_ALIGNED = tl.constexpr(2)  # 1: every address is a multiple of VEC elements
ACC = tl.constexpr(3)  # fp32 accumulator slice
GRAD = tl.constexpr(4)  # incoming gradient (bf16/fp16/fp32, contiguous)
PARAM = tl.constexpr(5)  # what the step updates: fp32 master, or the parameter itself
LP = tl.constexpr(6)  # low-precision parameter that receives the rounded update; or (HAS_REM)
# the int16 remainder of a bf16 parameter's exact master (a step has one or the other)
STATE0 = tl.constexpr(7)  # an update rule's state lists, in its op's order (.updates: which)
STATE1 = tl.constexpr(8)
STATE2 = tl.constexpr(9)
# the rows of its matrix, a value (not an address), for an update whose per-tensor scalars
# take its shape (Update.shaped: a split step's epilogue); 0 for the others
ROWS = tl.constexpr(10)
ROW = tl.constexpr(11)

# Elements per thread per access on aligned rows (see above).
VEC = tl.constexpr(4)

# Largest finite fp32; |x| <= FLT_MAX is false exactly for inf, -inf and nan.
FLT_MAX = tl.constexpr(3.4028234663852886e38)


def _jit(fn):
    """triton.jit with no value or alignment specialisation of any non-constexpr argument:
    one compiled variant per constexpr configuration (issue 10, item 8)."""
    import inspect

    names = [
        name for name, p in inspect.signature(fn).parameters.items()
        if not (p.annotation is tl.constexpr or p.annotation == "tl.constexpr")
    ]  # fmt: skip
    return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(fn)


# --- shared pieces ---------------------------------------------------------------------------
# A tl.multiple_of hint only holds on the op that computes the value in the function that
# sets it: set on a function argument it is silently dropped (seen: the PTX fell back to
# scalar accesses). So the hinted values (body end, pointers) are computed inside the helpers
# that hint them.


@triton.jit
def _row_is_aligned(chunks, tensors):
    t = tl.load(chunks + 2 * tl.program_id(0).to(tl.int64))
    return tl.load(tensors + t * ROW + IS_ALIGNED) != 0


@triton.jit
def _this_chunk(chunks, tensors, found_inf, chunk, ALIGNED: tl.constexpr, HAS_FOUND_INF: tl.constexpr):
    """(tensor-table row, first element, end of the vector body, end) of this program's chunk.

    On ALIGNED rows the body ends at the last multiple of VEC before the end (hinted, so the
    mask is constant over each vector) and the caller walks the rest as a scalar tail; on
    other rows the body is the whole chunk. With HAS_FOUND_INF a step is skipped on a
    non-finite window by making the range empty when found_inf is set (read on the device,
    so the host never waits for it)."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(chunks + 2 * pid)
    start = tl.load(chunks + 2 * pid + 1)
    row = tensors + t * ROW
    end = tl.minimum(start + chunk, tl.load(row + NUMEL))
    if HAS_FOUND_INF:
        end = tl.where(tl.load(found_inf) != 0, start, end)
    body_end = end
    if ALIGNED:
        body_end = tl.multiple_of(end - end % VEC, VEC)
    return row, start, body_end, end


@triton.jit
def _block(off, BLOCK: tl.constexpr):
    """Indices of the block at ``off``. Chunks start at multiples of the chunk size, a
    multiple of BLOCK, so every block does too."""
    return tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)


@triton.jit
def _address(row, column, DTYPE: tl.constexpr):
    """The tensor in ``column`` of ``row`` as a typed pointer."""
    return tl.load(row + column).to(tl.pointer_type(DTYPE))


@triton.jit
def _at(base, idx, ALIGNED: tl.constexpr):
    """Pointers base + idx, marked VEC-element aligned on aligned rows."""
    ptrs = base + idx
    if ALIGNED:
        ptrs = tl.multiple_of(ptrs, VEC * (base.dtype.element_ty.primitive_bitwidth // 8))
    return ptrs


@triton.jit
def _effective_grad(row, idx, mask, coef, grad_alpha,
                    GRAD_DTYPE: tl.constexpr, FUSED: tl.constexpr, GRADS_OVERWRITE: tl.constexpr,
                    MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr):
    """reference._effective_grad: coef * (acc, or grad_alpha*grad [+ acc] when fused)."""
    acc = _address(row, ACC, tl.float32)
    if FUSED:
        grad = _address(row, GRAD, GRAD_DTYPE)
        g = tl.load(_at(grad, idx, ALIGNED), mask=mask, other=0.0).to(tl.float32) * grad_alpha
        if not GRADS_OVERWRITE:
            g = tl.load(_at(acc, idx, ALIGNED), mask=mask, other=0.0) + g
    else:
        g = tl.load(_at(acc, idx, ALIGNED), mask=mask, other=0.0)
    g = g * coef
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _load_param(row, idx, mask, PARAM_DTYPE: tl.constexpr, LP_DTYPE: tl.constexpr, HAS_LP: tl.constexpr,
                HAS_REM: tl.constexpr, ALIGNED: tl.constexpr):
    """The fp32 value a step updates: the param (an fp32 master, or a parameter stepped in
    place), or with HAS_REM the exact master rebuilt from the bf16 param and its int16
    remainder (the table's LP column holds the remainders: a step has lp_params or remainders,
    never both). With HAS_LP the master follows the low-precision param (_follow_weight)."""
    param = _address(row, PARAM, PARAM_DTYPE)
    if HAS_REM:
        rem = _address(row, LP, tl.int16)
        weight = tl.load(_at(param, idx, ALIGNED), mask=mask, other=0.0)
        return _rebuild_master(weight, tl.load(_at(rem, idx, ALIGNED), mask=mask, other=0))
    else:
        p = tl.load(_at(param, idx, ALIGNED), mask=mask, other=0.0).to(tl.float32)
        if HAS_LP:
            lp = tl.load(_at(_address(row, LP, LP_DTYPE), idx, ALIGNED), mask=mask, other=0.0)
            p = _follow_weight(p, lp, LP_DTYPE)
        return p


@triton.jit
def _store_param(row, idx, mask, new_p, PARAM_DTYPE: tl.constexpr, LP_DTYPE: tl.constexpr,
                 HAS_LP: tl.constexpr, HAS_REM: tl.constexpr, ALIGNED: tl.constexpr):
    """Write the updated parameter, and its low-precision copy when there is one; with HAS_REM
    the new master split into the bf16 param and its remainder."""
    param = _address(row, PARAM, PARAM_DTYPE)
    if HAS_REM:
        weight, remainder = _split_master(new_p)
        tl.store(_at(param, idx, ALIGNED), weight, mask=mask)
        tl.store(_at(_address(row, LP, tl.int16), idx, ALIGNED), remainder, mask=mask)
    else:
        tl.store(_at(param, idx, ALIGNED), _round(new_p, PARAM_DTYPE), mask=mask)
        if HAS_LP:
            lp = _address(row, LP, LP_DTYPE)
            tl.store(_at(lp, idx, ALIGNED), _round(new_p, LP_DTYPE), mask=mask)


# --- accumulate ------------------------------------------------------------------------------


@_jit
def accumulate_kernel(
    chunks, tensors, partial_sumsq, partial_bad, first, alpha, chunk,
    GRAD_DTYPE: tl.constexpr, OVERWRITE: tl.constexpr, STATS: tl.constexpr, BLOCK: tl.constexpr,
):
    """acc = alpha * grad + (0 if OVERWRITE else acc), one chunk per program.

    With STATS, each program also writes the sum of squares of the values it wrote and a 0/1
    non-finite flag to ``partial_*[first + program id]``; ``reduce_stats_kernel`` folds them
    into sumsq/found_inf. Per-chunk partials (not atomics) fix the order of the sum, so the norm
    is the same from run to run.
    """
    if _row_is_aligned(chunks, tensors):
        _accumulate_chunk(chunks, tensors, partial_sumsq, partial_bad, first, alpha, chunk,
                          GRAD_DTYPE, OVERWRITE, STATS, True, BLOCK)
    else:
        _accumulate_chunk(chunks, tensors, partial_sumsq, partial_bad, first, alpha, chunk,
                          GRAD_DTYPE, OVERWRITE, STATS, False, BLOCK // VEC)


@triton.jit
def _accumulate_block(acc, grad, idx, mask, alpha, OVERWRITE: tl.constexpr, ALIGNED: tl.constexpr):
    # masked lanes read 0 and so add 0 to both statistics
    new = tl.load(_at(grad, idx, ALIGNED), mask=mask, other=0.0).to(tl.float32) * alpha
    if not OVERWRITE:
        new = tl.load(_at(acc, idx, ALIGNED), mask=mask, other=0.0) + new
    tl.store(_at(acc, idx, ALIGNED), new, mask=mask)
    return new


@triton.jit
def _accumulate_chunk(
    chunks, tensors, partial_sumsq, partial_bad, first, alpha, chunk,
    GRAD_DTYPE: tl.constexpr, OVERWRITE: tl.constexpr, STATS: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    row, start, body_end, end = _this_chunk(chunks, tensors, None, chunk, ALIGNED, False)
    acc = _address(row, ACC, tl.float32)
    grad = _address(row, GRAD, GRAD_DTYPE)
    sq = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for off in range(start, body_end, BLOCK):
        idx = _block(off, BLOCK)
        new = _accumulate_block(acc, grad, idx, idx < body_end, alpha, OVERWRITE, ALIGNED)
        if STATS:
            sq += new * new
            bad = tl.maximum(bad, tl.where(tl.abs(new) <= FLT_MAX, 0.0, 1.0))
    tail_sq = 0.0
    tail_bad = 0.0
    if ALIGNED:
        if body_end < end:  # the last 1-3 elements of a size that is not a multiple of VEC
            idx = body_end + tl.arange(0, VEC)
            new = _accumulate_block(acc, grad, idx, idx < end, alpha, OVERWRITE, False)
            tail_sq = tl.sum(new * new, axis=0)
            tail_bad = tl.max(tl.where(tl.abs(new) <= FLT_MAX, 0.0, 1.0), axis=0)
    if STATS:
        pid = first + tl.program_id(0)
        tl.store(partial_sumsq + pid, tl.sum(sq, axis=0) + tail_sq)
        tl.store(partial_bad + pid, tl.maximum(tl.max(bad, axis=0), tail_bad))


@_jit
def reduce_stats_kernel(
    partial_sumsq, partial_bad, n, sumsq, found_inf,
    HAS_SUMSQ: tl.constexpr, HAS_FOUND_INF: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: sumsq += sum(partial_sumsq); found_inf = max(found_inf, any partial_bad).

    It reads 8 bytes per chunk: 0.5 MB for 1e9 elements at 16384 elements per chunk. The
    order of the sum is fixed by n and BLOCK, so the result is the same from run to run.
    """
    sq = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < n
        if HAS_SUMSQ:
            sq += tl.load(partial_sumsq + idx, mask=mask, other=0.0)
        if HAS_FOUND_INF:
            bad = tl.maximum(bad, tl.load(partial_bad + idx, mask=mask, other=0.0))
    if HAS_SUMSQ:
        tl.store(sumsq, tl.load(sumsq) + tl.sum(sq, axis=0))
    if HAS_FOUND_INF:
        tl.store(found_inf, tl.maximum(tl.load(found_inf), tl.max(bad, axis=0)))


# --- optimizer steps: one generic kernel, each algorithm's update rule passed to it -----------
# step_kernel walks the chunks (aligned rows vectorised, their tails and other rows scalar, as
# accumulate), reads each block's effective gradient and fp32 master (_effective_grad,
# _load_param) and writes the updated parameter (_store_param); what is an algorithm's own is
# two @triton.jit functions passed as constexprs (one compiled kernel per algorithm and
# configuration, as the hand-written kernels were):
#
#   prepare(row, steps, lr_ptr, hyper, SWITCHES) -> per: the per-tensor scalars, once per
#       program. ``lr_ptr`` points to an fp64 scalar (the launcher widens an fp32 lr, so one
#       variant serves both): the scalars derived from lr are formed in double and rounded to
#       fp32 once, as torch's fused optimizers and the reference do;
#   update(row, idx, mask, g, p, per, hyper, SWITCHES, ALIGNED) -> new p: one block, its state
#       (columns STATE0..STATE2 of the row) read and written here.
#
# ``hyper`` is a tuple of the update's scalar arguments and ``SWITCHES`` a tuple of its constexpr
# switches, both made on the host by its ``arguments(h, s)``. Scalars the reference computes in
# Python double (1 - beta1, 1 - dampening) arrive precomputed, so they round to fp32 exactly as
# the reference's do; a double itself (a beta torch raises to the step count in double) as
# packed_double's two ints (bits._double reads them).


class Update(NamedTuple):
    """One algorithm's update rule in the generic step kernel (see above)."""

    prepare: object  # @triton.jit: the per-tensor scalars
    update: object  # @triton.jit: one block
    arguments: Callable  # (h, s) -> (hyper: tuple of floats and packed doubles, SWITCHES: tuple of bools)
    reads_steps: bool = True  # its prepare reads the step counts (the launcher checks them)
    # False: it reads and writes no parameter (a split step's prologue: the kernel's WRITES_PARAM)
    writes_param: bool = True
    # True: it reads no gradient; its first list is its per-element input, read in the
    # gradient's place (the GRAD column, any float dtype) and handed to update() as g, without
    # coef (a split step's epilogue: the middle's output; the kernel's READS_INPUT)
    reads_input: bool = False
    # True: its prepare reads the rows of the tensor's matrix (the ROWS column), the shape of
    # its first list's tensors (2-D)
    shaped: bool = False
    # triton 3.6 spills the update on 16-bit parameters without a master at NUM_WARPS (see
    # step_num_warps in the package's __init__): launched at twice the warps there
    wide_in_place_16bit: bool = False


@_jit
def step_kernel(
    chunks, tensors, steps, lr_ptr, coef_ptr, found_inf, chunk, grad_alpha, hyper,
    PARAM_DTYPE: tl.constexpr, LP_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    HAS_LP: tl.constexpr, HAS_REM: tl.constexpr, FUSED: tl.constexpr, GRADS_OVERWRITE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, MAXIMIZE: tl.constexpr,
    PREPARE: tl.constexpr, UPDATE: tl.constexpr, SWITCHES: tl.constexpr, BLOCK: tl.constexpr,
    WRITES_PARAM: tl.constexpr = True, READS_INPUT: tl.constexpr = False,
):
    """The reference's step op of the update rule UPDATE (with PREPARE), one chunk per program
    (WRITES_PARAM, READS_INPUT: the rule's Update.writes_param and reads_input)."""
    if _row_is_aligned(chunks, tensors):
        _step_chunk(chunks, tensors, steps, lr_ptr, coef_ptr, found_inf, chunk, grad_alpha, hyper,
                    PARAM_DTYPE, LP_DTYPE, GRAD_DTYPE, HAS_LP, HAS_REM, FUSED, GRADS_OVERWRITE,
                    HAS_FOUND_INF, MAXIMIZE, PREPARE, UPDATE, SWITCHES, True, BLOCK, WRITES_PARAM, READS_INPUT)
    else:
        _step_chunk(chunks, tensors, steps, lr_ptr, coef_ptr, found_inf, chunk, grad_alpha, hyper,
                    PARAM_DTYPE, LP_DTYPE, GRAD_DTYPE, HAS_LP, HAS_REM, FUSED, GRADS_OVERWRITE,
                    HAS_FOUND_INF, MAXIMIZE, PREPARE, UPDATE, SWITCHES, False, BLOCK // VEC,
                    WRITES_PARAM, READS_INPUT)


@triton.jit
def _step_block(
    row, idx, mask, coef, grad_alpha, per, hyper,
    PARAM_DTYPE: tl.constexpr, LP_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    HAS_LP: tl.constexpr, HAS_REM: tl.constexpr, FUSED: tl.constexpr, GRADS_OVERWRITE: tl.constexpr,
    MAXIMIZE: tl.constexpr, UPDATE: tl.constexpr, SWITCHES: tl.constexpr, ALIGNED: tl.constexpr,
    WRITES_PARAM: tl.constexpr, READS_INPUT: tl.constexpr,
):
    if READS_INPUT:  # the op's input, in the gradient's place, as it is
        g = tl.load(_at(_address(row, GRAD, GRAD_DTYPE), idx, ALIGNED), mask=mask, other=0.0).to(tl.float32)
    else:
        g = _effective_grad(row, idx, mask, coef, grad_alpha,
                            GRAD_DTYPE, FUSED, GRADS_OVERWRITE, MAXIMIZE, ALIGNED)
    if WRITES_PARAM:
        p = _load_param(row, idx, mask, PARAM_DTYPE, LP_DTYPE, HAS_LP, HAS_REM, ALIGNED)
        new_p = UPDATE(row, idx, mask, g, p, per, hyper, SWITCHES, ALIGNED)
        _store_param(row, idx, mask, new_p, PARAM_DTYPE, LP_DTYPE, HAS_LP, HAS_REM, ALIGNED)
    else:  # (no parameter read or written: the update's own stores are all it does)
        UPDATE(row, idx, mask, g, g, per, hyper, SWITCHES, ALIGNED)


@triton.jit
def _step_chunk(
    chunks, tensors, steps, lr_ptr, coef_ptr, found_inf, chunk, grad_alpha, hyper,
    PARAM_DTYPE: tl.constexpr, LP_DTYPE: tl.constexpr, GRAD_DTYPE: tl.constexpr,
    HAS_LP: tl.constexpr, HAS_REM: tl.constexpr, FUSED: tl.constexpr, GRADS_OVERWRITE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, MAXIMIZE: tl.constexpr,
    PREPARE: tl.constexpr, UPDATE: tl.constexpr, SWITCHES: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, WRITES_PARAM: tl.constexpr, READS_INPUT: tl.constexpr,
):
    row, start, body_end, end = _this_chunk(chunks, tensors, found_inf, chunk, ALIGNED, HAS_FOUND_INF)
    coef = tl.load(coef_ptr)
    per = PREPARE(row, steps, lr_ptr, hyper, SWITCHES)
    for off in range(start, body_end, BLOCK):
        idx = _block(off, BLOCK)
        _step_block(row, idx, idx < body_end, coef, grad_alpha, per, hyper,
                    PARAM_DTYPE, LP_DTYPE, GRAD_DTYPE, HAS_LP, HAS_REM, FUSED, GRADS_OVERWRITE,
                    MAXIMIZE, UPDATE, SWITCHES, ALIGNED, WRITES_PARAM, READS_INPUT)
    if ALIGNED:
        if body_end < end:
            idx = body_end + tl.arange(0, VEC)
            _step_block(row, idx, idx < end, coef, grad_alpha, per, hyper,
                        PARAM_DTYPE, LP_DTYPE, GRAD_DTYPE, HAS_LP, HAS_REM, FUSED, GRADS_OVERWRITE,
                        MAXIMIZE, UPDATE, SWITCHES, False, WRITES_PARAM, READS_INPUT)


@triton.jit
def _step_count(steps, row):
    """This tensor's step count (counting this step), from the op's ``steps``."""
    return tl.load(steps + tl.load(row + INDEX))

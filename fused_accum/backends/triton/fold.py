"""fold_pieces on Triton (contract: :func:`fused_accum.backends.reference.fold_pieces`): one
launch, each program owning BLOCK elements of acc and adding every piece to them in list order.

How the kernel finds the pieces:

- **rows** (the all-to-all's receive buffer: ``buf.unbind(0)`` of a contiguous [N, n] tensor, or
  any pieces that are contiguous and equally spaced in memory): from the first piece's address
  and the spacing, nothing else. One launch and nothing copied.
- **a table** (any other pieces): a device tensor of the N pieces' addresses, copied from the
  host before the launch (a memcpy, not a kernel; strided pieces are read through contiguous
  copies first, one copy kernel each). Callers that want the single launch pass rows.

The kernel lives here rather than in ``kernels`` (the step and accumulate math): it has no math
but the adds.
"""

from __future__ import annotations

from typing import List

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import reference
from . import checks
from .launch import _TL_DTYPE, _on

BLOCK = 1024
NUM_WARPS = 4


@triton.jit(do_not_specialize=["count"])
def fold_pieces_kernel(
    acc,
    first,  # pieces[0]
    table,  # int64 addresses of the pieces (FROM_TABLE), else unused
    stride,  # elements from one piece to the next (rows), else unused
    count,
    numel,
    DTYPE: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    OVERWRITE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < numel
    if OVERWRITE:  # start from the first piece itself: a -0.0 stays -0.0
        total = tl.load(first + idx, mask=mask, other=0.0).to(tl.float32)
        start = 1
    else:
        total = tl.load(acc + idx, mask=mask, other=0.0)
        start = 0
    piece = first + start * stride
    for k in range(start, count):
        if FROM_TABLE:
            piece = tl.load(table + k).to(tl.pointer_type(DTYPE))
        total = total + tl.load(piece + idx, mask=mask, other=0.0).to(tl.float32)
        if not FROM_TABLE:
            piece += stride
    tl.store(acc + idx, total, mask=mask)


def row_stride(pieces: List[Tensor]) -> int | None:
    """The spacing in elements of pieces that are contiguous and equally spaced in memory (the
    rows of one [N, n] buffer), else None."""
    if not all(p.is_contiguous() for p in pieces):
        return None
    size = pieces[0].element_size()
    base = pieces[0].data_ptr()
    step = pieces[1].data_ptr() - base if len(pieces) > 1 else 0
    if step % size:
        return None
    if any(p.data_ptr() - base != k * step for k, p in enumerate(pieces)):
        return None
    return step // size


def fold_pieces(acc: Tensor, pieces: List[Tensor], overwrite: bool) -> None:
    """reference.fold_pieces in one launch (see the module docstring for how pieces are passed)."""
    reference.check_fold_pieces(acc, pieces)
    if acc.numel() == 0:
        return
    device = checks.device_of(acc)
    keep: list = []
    pieces = [p.reshape(-1) for p in pieces]  # a view where it can be (rows stay rows)
    stride = row_stride(pieces)
    table = None
    if stride is None:
        pieces = list(checks.readable(pieces, keep))
        table = torch.tensor([p.data_ptr() for p in pieces], dtype=torch.int64).to(device, non_blocking=True)
    first = pieces[0]
    with _on(device):
        fold_pieces_kernel[(triton.cdiv(acc.numel(), BLOCK),)](
            acc,
            first,
            table if table is not None else acc,
            stride or 0,
            len(pieces),
            acc.numel(),
            DTYPE=_TL_DTYPE[first.dtype],
            FROM_TABLE=table is not None,
            OVERWRITE=bool(overwrite),
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    del keep

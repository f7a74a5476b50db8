"""fold_pieces on Triton (contract: :func:`fused_accum.backends.reference.fold_pieces`)."""

from __future__ import annotations

from typing import List

from torch import Tensor

from .. import reference


def fold_pieces(acc: Tensor, pieces: List[Tensor], overwrite: bool) -> None:
    """For now the reference's (same bits): the kernel follows."""
    reference.fold_pieces(acc, pieces, overwrite)

"""The launch tables of the triton backend, laid out on the host.

A launch reads two int64 tables (what each column means: :mod:`.kernels`): the *tensor table*,
one row of ``ROW`` columns per tensor (size, position in the op's lists, alignment flag, raw
addresses), and the *chunk table*, one (row, first element) pair per program. This module turns
what a call supplies, the addresses and element sizes of each table column, into those arrays
with numpy over whole columns, and splits a call's tensors into the dtype groups a kernel is
specialised on (one launch each). It holds no state and touches no device: the package's
``__init__`` sizes the chunks and copies the result to the device.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from . import kernels

VEC = kernels.VEC.value
ROW = kernels.ROW.value

# A table column's addresses, one per row, and the element size of what they point to (one
# for the whole column, or a function of the dtype group's key when it depends on the group);
# None: the column holds values, not addresses (kernels.ROWS).
ElementSize = Union[int, Callable[[tuple], int], None]
Columns = Dict[int, Tuple[np.ndarray, ElementSize]]


class Tables(NamedTuple):
    """One launch's tables, on the device the kernels run on."""

    tensors: Tensor  # int64 [n_tensors, ROW], see kernels
    chunks: Tensor  # int64 [n_chunks, 2]: (row of the tensor table, first element)
    n_chunks: int
    chunk: int  # elements per chunk (the kernels' run-time ``chunk``)
    host: Optional[Tensor]  # the pinned source of a copy captured into a CUDA graph


def chunk_table(numels, chunk: int) -> np.ndarray:
    """(row, first element) of every chunk of tensors of ``numels`` elements, in order, on the
    host, vectorised. Empty tensors have no chunk. int64, so starts past 2**31 are exact."""
    numels = np.asarray(numels, dtype=np.int64)
    per_tensor = (numels + chunk - 1) // chunk
    rows = np.repeat(np.arange(len(numels), dtype=np.int64), per_tensor)
    first_chunk = np.cumsum(per_tensor) - per_tensor
    starts = (np.arange(len(rows), dtype=np.int64) - first_chunk[rows]) * chunk
    return np.stack([rows, starts], axis=1)


def aligned(addresses: Dict[int, Tuple[np.ndarray, int]]) -> np.ndarray:
    """Per row: 1 when every address is a multiple of VEC elements of its operand (VEC * element
    size bytes), so the kernels may use vector accesses. The optimizer's flat buffers (64-element
    slices) and freshly allocated tensors are; a view at an odd offset is not. Sizes need not be
    multiples of VEC: the kernels walk the last numel % VEC elements as a scalar tail."""
    ok = None
    for address, element_size in addresses.values():
        if element_size is None:  # (values, not addresses)
            continue
        this = address % (VEC * element_size) == 0
        ok = this if ok is None else ok & this
    return ok.astype(np.int64)


def host_tables(
    numel: np.ndarray, index: np.ndarray, addresses: Dict[int, Tuple[np.ndarray, int]], chunk: int
) -> Tuple[Tensor, int]:
    """The tensor table and then the chunk table of one launch, flat in one int64 CPU tensor
    (so that one copy moves both), and the number of chunks. ``addresses`` maps a table column
    to (addresses, element size) for the rows; absent columns stay 0."""
    tensors = np.zeros((len(numel), ROW), dtype=np.int64)
    tensors[:, kernels.NUMEL.value] = numel
    tensors[:, kernels.INDEX.value] = index
    tensors[:, kernels.IS_ALIGNED.value] = aligned(addresses)
    for column, (address, _) in addresses.items():
        tensors[:, column] = address
    chunks = chunk_table(numel, chunk)
    return torch.from_numpy(np.concatenate([tensors.reshape(-1), chunks.reshape(-1)])), len(chunks)


def dtype_groups(keys: Sequence[tuple]) -> "OrderedDict[tuple, np.ndarray]":
    """Row indices by key (the dtypes a kernel is specialised on), in first-seen order."""
    first = keys[0]
    if keys.count(first) == len(keys):  # the usual case: one dtype per list (a C loop)
        return OrderedDict([(first, np.arange(len(keys), dtype=np.int64))])
    groups: "OrderedDict[tuple, List[int]]" = OrderedDict()
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return OrderedDict((k, np.asarray(v, dtype=np.int64)) for k, v in groups.items())


def groups(numels: Sequence[int], columns: Columns, keys: Sequence[tuple]) -> Iterator[tuple]:
    """Per dtype group, in first-seen order: (key, sizes, rows, addresses), what one launch's
    tables are built from. ``keys[i]`` is row i's dtypes; ``columns`` covers every row."""
    numel = np.asarray(numels, dtype=np.int64)
    for key, rows in dtype_groups(keys).items():
        addresses = {}
        for column, (address, element_size) in columns.items():
            size = element_size if element_size is None or isinstance(element_size, int) else element_size(key)
            addresses[column] = (address[rows], size)
        yield key, numel[rows], rows, addresses

"""Launch plans of the triton backend: what a call is keyed by, what its checks established, and
the table columns a plan is built from.

Every call takes one path (the package's ``__init__``), whether or not the caller passed
``plan=``. A call has

- a *where*: the part of its key that does not change from call to call. With a caller plan it
  is the plan and what the plan promises is unchanged; without one it holds every size and
  every address the call does not read below, so such a call is a plan of its own;
- a *read*: the addresses and dtypes of what the model or the backward owns, read each call
  (the gradients; ``lp_params``, or ``params`` when they are their own fp32 masters);
- a *template*: what checking the call established (sizes, slice starts, the addresses of the
  buffers a plan keeps). A caller plan's is made by its first call and kept; a call without
  one makes it when its key misses the plan cache.

The key is (where, stream, chunking, read); a hit launches the cached tables, a miss builds
them from the template's columns and the read's.
"""

from __future__ import annotations

import operator
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from .. import ext
from . import checks, kernels, tables

# Unbound C methods: one C call per tensor through map(), no Python frame per tensor.
data_ptr = Tensor.data_ptr
numel = Tensor.numel
dtype = operator.attrgetter("dtype")


class Key:
    """A plan key: a tuple of thousands of ints whose hash is computed once (a dict lookup, an
    LRU move and a store would otherwise hash it again each: ~0.3 ms each at 2,048 tensors)."""

    __slots__ = ("parts", "hash")

    def __init__(self, *parts):
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, Key) and self.hash == other.hash and self.parts == other.parts


class Template(NamedTuple):
    """What checking a call established: ``None`` in ``numels`` means a caller plan's first call
    had a non-contiguous operand and the plan is not used (its calls go without it)."""

    numels: Optional[tuple]  # per row
    columns: dict  # accumulate: {"starts": slice starts}; steps: table column -> (addresses, size)
    param_dtypes: Optional[tuple]  # steps whose params are persistent (masters): their dtypes


class Plan(NamedTuple):
    """Everything a call launches: per dtype group, its key (the dtypes), tables, and first
    chunk among all the call's (where accumulate's statistics partials start)."""

    launches: Tuple[Tuple[tuple, tables.Tables, int], ...]
    total_chunks: int


_UNUSABLE = Template(None, {}, None)  # copies every call: not worth a plan


def _addresses(xs: Sequence[Tensor]) -> np.ndarray:
    return np.asarray(tuple(map(data_ptr, xs)), dtype=np.int64)


def _read_in_python(tensors: List[Tensor]):
    return tuple(map(data_ptr, tensors)), tuple(map(dtype, tensors))


# What accumulate reads per call: every gradient's address and dtype, in one C++ pass where the
# extension is built (fused_accum._C.addresses_and_dtypes, ~0.05 us per tensor), else two
# Python reads (~0.14 us per tensor each: together more than a 2,048-tensor call's budget).
addresses_and_dtypes = getattr(ext._C, "addresses_and_dtypes", None) or _read_in_python


# --- accumulate ----------------------------------------------------------------------------------


def accumulate_where(plan, device: torch.device, acc: Tensor, offsets: Tensor, numels: tuple = ()) -> Key:
    """acc and offsets by value (cheap: two tensors). A caller plan promises the gradients' sizes
    (pass none); a call without one (``plan`` None) is keyed by them."""
    return Key("accumulate", plan, device, acc.data_ptr(), acc.numel(), offsets.numpy().tobytes(), numels)


def accumulate_template(acc: Tensor, offsets: Tensor, grads: List[Tensor]) -> Template:
    """Every check of the call but the gradients' dtypes (read each call): sizes and slices."""
    if not checks.all_contiguous(grads):
        return _UNUSABLE
    numels = tuple(map(numel, grads))
    return Template(numels, {"starts": checks.slice_starts(acc, offsets, grads, numels)}, None)


def accumulate_columns(acc: Tensor, template: Template, ptrs: tuple) -> tables.Columns:
    """The tensor table's columns: each slice of acc, and the gradient it takes."""
    acc_address = acc.data_ptr() + 4 * np.asarray(template.columns["starts"], dtype=np.int64)
    return {
        kernels.ACC.value: (acc_address, 4),
        kernels.GRAD.value: (np.asarray(ptrs, dtype=np.int64), lambda key: key[0].itemsize),
    }


# --- steps ---------------------------------------------------------------------------------------

# Table columns of the optimizer-state lists, in the order the step ops pass them.
STATE_COLUMNS = (kernels.STATE0.value, kernels.STATE1.value, kernels.STATE2.value)
# The lists a step reads every call: their table column and their place in a dtype group's key
# (param, lp, grad dtypes).
_READ_COLUMNS = {
    "params": (kernels.PARAM.value, 0),
    "lp_params": (kernels.LP.value, 1),
    "grads": (kernels.GRAD.value, 2),
}


def step_where(name: str, plan, device, params, states, accs, lp_params, grads, remainders=()) -> Key:
    """A caller plan's where: the lists it keeps (accs, states, remainders, and params when they
    are masters) are promised to be views at fixed places of buffers that move, if ever, as a
    whole, so the first address of each is enough."""
    firsts = [accs[0].data_ptr(), *(xs[0].data_ptr() for xs in states.values())]
    if lp_params:
        firsts.append(params[0].data_ptr())
    if remainders:
        firsts.append(remainders[0].data_ptr())
    return Key(name, plan, device, tuple(states), len(params), bool(lp_params), bool(grads), bool(remainders), *firsts)


def unplanned_step_where(name: str, device, params, states, accs, lp_params, grads, remainders=()) -> Key:
    """A call without a plan is keyed by every address and size it does not read each call. The
    fused gradients are new tensors every window: their sizes are in the key; params, lp_params,
    remainders and the state lists are checked against accs on a miss, and keep their size while
    their address is unchanged."""
    kept = [tuple(map(data_ptr, xs)) for xs in (accs, *states.values())]
    if lp_params:  # the masters are kept, not read (see step_read)
        kept += [tuple(map(data_ptr, params)), tuple(map(dtype, params))]
    if remainders:  # the optimizer's buffer, kept; the bf16 params are read (see step_read)
        kept += ["remainders", tuple(map(data_ptr, remainders))]
    return Key(name, None, device, tuple(states), tuple(map(numel, accs)), tuple(map(numel, grads)), *kept)


def step_read(params, lp_params, grads) -> dict:
    """What a step reads every call, by argument name: what the model or the backward owns (with
    remainders, the params: the model's bf16 parameters)."""
    read = {"lp_params": lp_params} if lp_params else {"params": params}
    if grads:
        read["grads"] = grads
    return read


def step_template(name, params, states, accs, lp_params, grads, device, remainders=()) -> Template:
    """Every check of a step, and the addresses of the lists a plan keeps (accs, states,
    remainders, and params when they are masters)."""
    checks.validate_step(name, params, states, accs, lp_params, grads, device, remainders)
    if not checks.all_contiguous(params, lp_params, grads, remainders):
        return _UNUSABLE
    columns = {kernels.ACC.value: (_addresses(accs), 4)}
    for column, xs in zip(STATE_COLUMNS, states.values()):
        columns[column] = (_addresses(xs), 4)
    if remainders:  # in the LP column (a step has lp_params or remainders): the kernels' HAS_REM
        columns[kernels.LP.value] = (_addresses(remainders), 2)
    param_dtypes = None
    if lp_params:  # params are the optimizer's masters: kept by the plan
        param_dtypes = tuple(map(dtype, params))
        columns[kernels.PARAM.value] = (_addresses(params), lambda key: key[0].itemsize)
    return Template(tuple(map(numel, accs)), columns, param_dtypes)


def step_columns(
    template: Template, read: dict, ptrs: list, dtypes: list, remainders: bool = False, rows: tuple = ()
) -> Tuple[tables.Columns, list]:
    """The tensor table's columns (the template's and the read lists', and ``rows``, the rows of
    each matrix where the update takes its shape) and each row's dtype key (param, lp, grad
    dtypes; int16 in the lp place with remainders; fp32 where a list is absent: a placeholder,
    not read)."""
    columns = dict(template.columns)
    if rows:
        columns[kernels.ROWS.value] = (np.asarray(rows, dtype=np.int64), None)
    for what, addresses in zip(read, ptrs):
        column, position = _READ_COLUMNS[what]
        columns[column] = (np.asarray(addresses, dtype=np.int64), lambda key, p=position: key[p].itemsize)
    read_dtypes = dict(zip(read, dtypes))
    fp32 = [torch.float32] * len(template.numels)
    keys = list(
        zip(
            template.param_dtypes or read_dtypes["params"],
            [torch.int16] * len(fp32) if remainders else read_dtypes.get("lp_params") or fp32,
            read_dtypes.get("grads") or fp32,
        )
    )
    return columns, keys

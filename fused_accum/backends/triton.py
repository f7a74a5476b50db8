"""Triton backend: launchers for the multi-tensor kernels in :mod:`.triton_kernels`.

The four ops of :mod:`fused_accum.backends.reference`, same signatures and contracts, each
in one launch per dtype group (plus one tiny launch folding the norm/non-finite partials when
those are asked for): any number of tensors, from 1 element to billions, goes through a device
table of raw addresses and sizes rather than one launch per tensor. This module holds the
plumbing (validation, dtype groups, tables, grids); the formulas are in the kernels.

It is chosen for CUDA tensors when the C++/CUDA extension is absent, and runs on CPU tensors
under ``TRITON_INTERPRET=1`` (set before triton is imported) as a test of the kernels: nothing
here assumes CUDA.

torch.compile: the ops are traced through the opaque custom ops of :mod:`fused_accum.ops`,
which declare what they mutate. These kernels are deliberately *not* wrapped with
``torch.library.triton_op``/``wrap_triton``: they reach the tensors they write through
addresses in a table, which Inductor's mutation analysis of a wrapped kernel cannot see, so it
would treat the accumulators and parameters as unchanged and could reorder or drop their reads.
"""
from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Iterable, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

import triton  # an ImportError here makes the backend unavailable (see backends._load)
import triton.language as tl

from . import reference
from . import triton_kernels as kernels

# One program owns a chunk of at most CHUNK elements of one tensor, walked in BLOCK steps.
# BLOCK = 1024 with 4 warps is 8 elements per thread per tensor, two vector accesses of VEC = 4
# (16 bytes of fp32, 8 of bf16; see triton_kernels): 8 to 10 independent loads in flight per
# thread in a fused step. CHUNK = 16 blocks keeps the chunk table small (16 bytes per 16384
# elements: 1 MB for 1e9 parameters, 0.01% of the 10 bytes/element an accumulate moves) while
# still giving an H200's 132 SMs thousands of programs on any large bucket; a tensor smaller
# than a chunk is one program. Both are first guesses to be swept on the GPU (docs/triton_backend.md).
BLOCK = 1024
CHUNK = 16 * BLOCK
NUM_WARPS = 4
# Let a*b + c contract to one FMA (one rounding instead of two; the kernel tests allow ~1 ulp).
# Explicit because Triton 3.9 warns that its default will change in 3.10.
FP_FUSION = True
# reduce_stats_kernel is one program reading 8 bytes per chunk: a wider block, more warps.
REDUCE_BLOCK = 4096
REDUCE_WARPS = 8

# Device tables keyed by their own contents (every address and size), so a hit is always
# correct. The optimizer calls with the same buffers every step, and the caching allocator
# often hands the same gradient addresses back every micro-batch: a hit skips building the
# table on the host and copying it to the device. 64 entries of ~16 bytes per chunk.
_TABLE_CACHE_SIZE = 64
_table_cache: "OrderedDict[tuple, _Tables]" = OrderedDict()

# Triton decides at decoration time, when triton_kernels was imported.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def unavailable_reason(name: str) -> str:
    """"" when this backend can run (where it may run is decided in backends.availability)."""
    major = int(triton.__version__.split(".")[0])
    return "" if major >= 3 else f"the triton backend needs triton >= 3.0, found {triton.__version__}"


# --- tables ----------------------------------------------------------------------------------


class _Tables(NamedTuple):
    tensors: Tensor  # int64 [n_tensors, ROW], see triton_kernels
    chunks: Tensor  # int64 [n_chunks, 2]: (row of the tensor table, first element)
    n_chunks: int


def chunk_table(numels: Tensor) -> Tensor:
    """(row, first element) of every chunk of tensors of ``numels`` elements, in order, on the
    host. Empty tensors have no chunk. int64, so starts past 2**31 are exact."""
    per_tensor = (numels + CHUNK - 1) // CHUNK
    rows = torch.repeat_interleave(torch.arange(len(numels)), per_tensor)
    first_chunk = torch.cumsum(per_tensor, 0) - per_tensor
    starts = (torch.arange(len(rows)) - first_chunk[rows]) * CHUNK
    return torch.stack([rows, starts], dim=1)


def _tables(device: torch.device, rows: List[tuple]) -> _Tables:
    # The stream is part of the key: a table is used on the stream its copy was queued on.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, CHUNK, tuple(rows))
    hit = _table_cache.get(key)
    if hit is not None:
        _table_cache.move_to_end(key)
        return hit
    tensors = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), kernels.ROW.value)
    chunks = chunk_table(tensors[:, kernels.NUMEL.value])
    host = torch.cat([tensors.reshape(-1), chunks.reshape(-1)])
    if device.type == "cuda":
        # pinned + non_blocking: the copy is queued on the stream, the host does not wait
        host = host.pin_memory().to(device, non_blocking=True)
    split = tensors.numel()
    tables = _Tables(host[:split].view(tensors.shape), host[split:].view(chunks.shape), len(chunks))
    _table_cache[key] = tables
    if len(_table_cache) > _TABLE_CACHE_SIZE:
        _table_cache.popitem(last=False)
    return tables


class _Operand(NamedTuple):
    """Where a table row's tensor starts, and its element size (for the alignment test)."""

    address: int
    element_size: int


def _operand(t: Optional[Tensor]) -> Optional[_Operand]:
    return None if t is None else _Operand(t.data_ptr(), t.element_size())


def _row(numel: int, index: int, **operands: Optional[_Operand]) -> tuple:
    """One tensor-table row, in the column order of triton_kernels: size, list position,
    alignment flag, then the address of each operand by column name (0 where absent)."""
    present = {name: o for name, o in operands.items() if o is not None}
    address = {name: o.address for name, o in present.items()}
    aligned = _aligned(numel, present.values())
    return (
        numel, index, int(aligned),
        address.get("acc", 0), address.get("grad", 0), address.get("param", 0),
        address.get("lp", 0), address.get("state0", 0), address.get("state1", 0),
    )  # fmt: skip


def _aligned(numel: int, operands: Iterable[_Operand]) -> bool:
    """True when the kernels may use VEC-element vector accesses on this row: its size and
    every address are multiples of VEC elements. The optimizer's flat buffers (64-element
    slices) and freshly allocated gradients are; a view at an odd offset is not."""
    vec = kernels.VEC.value
    return numel % vec == 0 and all(o.address % (vec * o.element_size) == 0 for o in operands)


# --- validation and layout -------------------------------------------------------------------


def _device_of(t: Tensor) -> torch.device:
    device = t.device
    if _INTERPRETED and device.type != "cpu":
        # the interpreter copies tensor arguments to the host, but not the tensors that the
        # tables address: it would dereference device addresses on the CPU
        raise RuntimeError(
            f"under TRITON_INTERPRET=1 the triton backend runs on CPU tensors only, got {device}"
        )
    return device


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not on the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_acc(name: str, i: int, t: Tensor, device: torch.device) -> None:
    if t.dtype != torch.float32 or t.dim() != 1 or t.stride(0) != 1 or t.device != device:
        raise ValueError(
            f"{name}[{i}] must be a 1-D contiguous float32 tensor on {device}, "
            f"got {t.dtype} shape {tuple(t.shape)} stride {t.stride()} on {t.device}"
        )


def _check_same(name: str, i: int, t: Tensor, numel: int, device: torch.device) -> None:
    if t.numel() != numel or t.device != device:
        raise ValueError(
            f"{name}[{i}] must have {numel} elements on {device} like accs[{i}], "
            f"got {t.numel()} on {t.device}"
        )


def _check_dtype(name: str, i: int, t: Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}[{i}] must be bfloat16, float16 or float32, got {t.dtype}")


def _check_scalar(name: str, t: Optional[Tensor], device: torch.device) -> None:
    if t is not None and (t.dtype != torch.float32 or t.numel() != 1 or t.device != device):
        raise ValueError(
            f"{name} must be a one-element float32 tensor on {device}, "
            f"got {t.dtype} with {t.numel()} elements on {t.device}"
        )


def _readable(t: Tensor, keep: list) -> Tensor:
    """A contiguous tensor with t's elements in logical order, for reading through an address.

    Non-contiguous gradients are rare (autograd gives a parameter's gradient the parameter's
    layout), so a copy here costs less than a strided path in every kernel."""
    if t.is_contiguous():
        return t
    t = t.contiguous()
    keep.append(t)  # alive until the launch has been queued
    return t


def _writable(t: Tensor, write_back: list) -> Tensor:
    """Like _readable for a tensor the kernel writes: the copy is copied back after the launch
    (a channels_last parameter, say). The optimizer's own buffers are always contiguous."""
    if t.is_contiguous():
        return t
    c = t.contiguous()
    write_back.append((t, c))
    return c


def _groups(keys: List[tuple]) -> "OrderedDict[tuple, List[int]]":
    """Indices by key (the dtypes a kernel is specialised on), in first-seen order."""
    groups: "OrderedDict[tuple, List[int]]" = OrderedDict()
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


# --- accumulate ------------------------------------------------------------------------------


def accumulate(
    acc: Tensor,
    offsets: Tensor,
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor] = None,
    sumsq: Optional[Tensor] = None,
) -> None:
    """reference.accumulate, in one launch per gradient dtype (+1 for found_inf/sumsq)."""
    starts = reference.slice_starts(acc, offsets, grads)
    if not grads:
        return
    device = _device_of(acc)
    _check_scalar("found_inf", found_inf, device)
    _check_scalar("sumsq", sumsq, device)
    for i, grad in enumerate(grads):
        _check_dtype("grads", i, grad)
    stats = found_inf is not None or sumsq is not None

    keep: list = []
    grads = [_readable(g, keep) for g in grads]
    base = acc.data_ptr()
    launches = []
    for (dtype,), members in _groups([(g.dtype,) for g in grads]).items():
        rows = [
            _row(grads[i].numel(), i, acc=_Operand(base + 4 * starts[i], 4), grad=_operand(grads[i]))
            for i in members
        ]
        launches.append((dtype, _tables(device, rows)))
    total_chunks = sum(t.n_chunks for _, t in launches)
    if total_chunks == 0:
        return
    # row 0: per-chunk sums of squares, row 1: per-chunk non-finite flags
    partials = torch.empty((2, total_chunks), dtype=torch.float32, device=device) if stats else None
    with _on(device):
        first = 0
        for dtype, tables in launches:
            if tables.n_chunks == 0:
                continue
            if stats:
                part_sq, part_bad = partials[0, first:], partials[1, first:]
            else:  # never dereferenced (STATS=False), any tensor will do
                part_sq = part_bad = tables.chunks
            kernels.accumulate_kernel[(tables.n_chunks,)](
                tables.chunks, tables.tensors, part_sq, part_bad, float(alpha),
                GRAD_DTYPE=_TL_DTYPE[dtype], OVERWRITE=bool(overwrite), STATS=stats,
                CHUNK=CHUNK, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
            )  # fmt: skip
            first += tables.n_chunks
        if stats:
            kernels.reduce_stats_kernel[(1,)](
                partials[0], partials[1], total_chunks,
                sumsq if sumsq is not None else partials, found_inf if found_inf is not None else partials,
                HAS_SUMSQ=sumsq is not None, HAS_FOUND_INF=found_inf is not None,
                BLOCK=REDUCE_BLOCK, num_warps=REDUCE_WARPS, enable_fp_fusion=FP_FUSION,
            )  # fmt: skip
    del keep  # the copies may go: the launches are queued on the stream in order


# --- optimizer steps -------------------------------------------------------------------------


def _step(
    kernel,
    name: str,
    params: List[Tensor],
    states: "OrderedDict[str, List[Tensor]]",
    accs: List[Tensor],
    steps: Optional[Tensor],
    lr: Tensor,
    coef: Tensor,
    lp_params: Sequence[Tensor],
    grads: Sequence[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    scalars: tuple,
    flags: dict,
) -> None:
    """The launcher shared by the three step ops: validate, group by dtypes, launch.

    ``states`` are the optimizer-state lists by argument name (0, 1 or 2 of them, fp32 like
    accs, in table columns STATE0, STATE1); ``scalars`` and ``flags`` are the kernel's own
    hyper-parameters and constexpr switches."""
    n = len(params)
    for what, xs in [("accs", accs), *states.items()]:
        if len(xs) != n:
            raise ValueError(f"{name}: {what} must be as long as params ({n}), got {len(xs)}")
    if lp_params and len(lp_params) != n:
        raise ValueError(f"{name}: lp_params must be empty or as long as params ({n}), got {len(lp_params)}")
    if grads and len(grads) != n:
        raise ValueError(f"{name}: grads must be empty or as long as params ({n}), got {len(grads)}")
    if n == 0:
        return
    device = _device_of(accs[0])
    _check_scalar("lr", lr, device)
    _check_scalar("coef", coef, device)
    _check_scalar("found_inf", found_inf, device)
    if steps is not None and (steps.dtype != torch.float32 or steps.numel() < n or steps.device != device):
        raise ValueError(f"{name}: steps must be a float32 tensor of {n} step counts on {device}")

    for i in range(n):
        numel = accs[i].numel()
        _check_acc("accs", i, accs[i], device)
        _check_same("params", i, params[i], numel, device)
        _check_dtype("params", i, params[i])
        for what, xs in states.items():
            _check_acc(what, i, xs[i], device)
        if lp_params:
            _check_same("lp_params", i, lp_params[i], numel, device)
            _check_dtype("lp_params", i, lp_params[i])
        if grads:
            _check_same("grads", i, grads[i], numel, device)
            _check_dtype("grads", i, grads[i])

    keep: list = []
    write_back: list = []
    params = [_writable(p, write_back) for p in params]
    lp_params = [_writable(p, write_back) for p in lp_params]
    grads = [_readable(g, keep) for g in grads]
    state_lists = list(states.values())
    keys, rows = [], []
    for i in range(n):
        rows.append(_row(
            accs[i].numel(), i, acc=_operand(accs[i]), param=_operand(params[i]),
            grad=_operand(grads[i] if grads else None), lp=_operand(lp_params[i] if lp_params else None),
            state0=_operand(state_lists[0][i] if len(state_lists) > 0 else None),
            state1=_operand(state_lists[1][i] if len(state_lists) > 1 else None),
        ))  # fmt: skip
        keys.append((
            params[i].dtype,
            lp_params[i].dtype if lp_params else torch.float32,  # placeholder: not read
            grads[i].dtype if grads else torch.float32,  # placeholder: not read
        ))  # fmt: skip

    steps_arg = () if steps is None else (steps.contiguous(),)
    with _on(device):
        for (param_dtype, lp_dtype, grad_dtype), members in _groups(keys).items():
            tables = _tables(device, [rows[i] for i in members])
            if tables.n_chunks == 0:
                continue
            kernel[(tables.n_chunks,)](
                tables.chunks, tables.tensors, *steps_arg, lr, coef,
                found_inf if found_inf is not None else coef,  # not read unless HAS_FOUND_INF
                float(grad_alpha), *scalars,
                PARAM_DTYPE=_TL_DTYPE[param_dtype], LP_DTYPE=_TL_DTYPE[lp_dtype],
                GRAD_DTYPE=_TL_DTYPE[grad_dtype], HAS_LP=bool(lp_params), FUSED=bool(grads),
                GRADS_OVERWRITE=bool(grads_overwrite), HAS_FOUND_INF=found_inf is not None,
                **flags, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
            )  # fmt: skip
    for original, copy in write_back:
        original.copy_(copy)
    del keep


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
    """reference.sgd_step in one launch per dtype group."""
    states = OrderedDict(momentum_bufs=momentum_bufs) if momentum != 0 else OrderedDict()
    _step(
        kernels.sgd_kernel, "sgd_step", params, states, accs, steps, lr, coef,
        lp_params, grads, grad_alpha, grads_overwrite, found_inf,
        scalars=(float(momentum), 1.0 - float(dampening), float(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize), HAS_WEIGHT_DECAY=weight_decay != 0,
                   HAS_MOMENTUM=momentum != 0, NESTEROV=bool(nesterov)),
    )  # fmt: skip


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
) -> None:
    """reference.adam_step (Adam / AdamW) in one launch per dtype group."""
    _step(
        kernels.adam_kernel, "adam_step", params,
        OrderedDict(exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs), accs, steps, lr, coef,
        lp_params, grads, grad_alpha, grads_overwrite, found_inf,
        scalars=(float(beta1), float(beta2), 1.0 - float(beta1), 1.0 - float(beta2),
                 float(eps), float(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize), HAS_WEIGHT_DECAY=weight_decay != 0,
                   DECOUPLED=bool(decoupled)),
    )  # fmt: skip


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
    """reference.lion_step in one launch per dtype group (``steps`` is unused, as there)."""
    del steps
    _step(
        kernels.lion_kernel, "lion_step", params, OrderedDict(exp_avgs=exp_avgs), accs, None, lr, coef,
        lp_params, grads, grad_alpha, grads_overwrite, found_inf,
        scalars=(float(beta1), float(beta2), 1.0 - float(beta1), 1.0 - float(beta2),
                 float(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize)),
    )  # fmt: skip

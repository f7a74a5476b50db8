"""Triton backend: launchers for the multi-tensor kernels in :mod:`.triton_kernels`.

The four ops of :mod:`fused_accum.backends.reference`, same signatures and contracts, each
in one launch per dtype group (plus one tiny launch folding the norm/non-finite partials when
those are asked for): any number of tensors, from 1 element to billions, goes through a device
table of raw addresses and sizes rather than one launch per tensor. This module holds the
plumbing (validation, dtype groups, tables, grids); the formulas are in the kernels.

It is chosen for CUDA tensors when the C++/CUDA extension is absent, and runs on CPU tensors
under ``TRITON_INTERPRET=1`` (set before triton is imported) as a test of the kernels: nothing
here assumes CUDA.

Host cost. A call reads, per tensor, only what can change between calls (address, size,
dtype, contiguity: four C calls from ``map``), builds a key from them and looks the launch plan
up; only a miss validates everything and builds the tables, with numpy over whole columns
rather than per row. Each such read costs ~0.14 us per tensor on the development CPU (0.28 ms
for 2,048 tensors), so a step over 5 lists of 2,048 reads for ~6 ms. A caller that passes
``plan=`` (see :func:`accumulate` and :func:`_step`) promises which tensors stay the same from
call to call; then only the gradients and the model's parameters are read (address and dtype),
which is what meets issue 10's host-time goals. ``benchmarks/triton_host.py`` measures both
paths with the kernels stubbed.

CUDA graphs. Nothing here reads a device value on the host (lr, coef, steps and found_inf are
read by the kernels), so a captured call replays with the current values. A graph holds the
raw addresses of the tables it was captured with: a table used during capture is moved out of
the LRU into a registry that is never evicted (:func:`release_captured_tables` empties it once
those graphs are gone). One built during capture is copied from a slice of a pinned arena that
was allocated before the capture (no pinned allocation happens during one) and is never
reused, since every replay copies from it again. The tables are keyed by the current stream.

torch.compile: the ops are traced through the opaque custom ops of :mod:`fused_accum.ops`,
which declare what they mutate. These kernels are deliberately *not* wrapped with
``torch.library.triton_op``/``wrap_triton``: they reach the tensors they write through
addresses in a table, which Inductor's mutation analysis of a wrapped kernel cannot see, so it
would treat the accumulators and parameters as unchanged and could reorder or drop their reads.
"""
from __future__ import annotations

import contextlib
import operator
import os
import struct
import threading
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

import triton  # an ImportError here makes the backend unavailable (see backends._load)
import triton.language as tl

from . import ext, reference
from . import triton_kernels as kernels

# One program owns a chunk of one tensor, walked in BLOCK steps. BLOCK = 1024 with 4 warps is
# 8 elements per thread per tensor, two vector accesses of VEC = 4 (16 bytes of fp32, 8 of
# bf16; see triton_kernels): 8 to 10 independent loads in flight per thread in a fused step.
BLOCK = 1024
NUM_WARPS = 4
# The chunk is sized per launch (a power of two from BLOCK to MAX_CHUNK_BLOCKS * BLOCK) so the
# grid has at least PROGRAMS_PER_SM programs per SM where the tensors are big enough: 16 is
# ~4 waves of the ~4 programs of 128 threads an SM keeps resident at these kernels' 40-72
# registers, so the last, partial wave is a small part of the time. The fixed 16,384-element
# chunk gave a 1M-element tensor 64 programs for an H200's 132 SMs; now it gets 1,024 (chunk
# = BLOCK), and a 1e9-element bucket 15k (chunk = 64 blocks: the chunk table costs 16 bytes per
# 65,536 elements). First guesses: benchmarks/triton_sweep.py sweeps them on a GPU.
PROGRAMS_PER_SM = 16
MAX_CHUNK_BLOCKS = 64
# No automatic FMA contraction: the kernels write tl.fma exactly where the reference (and the
# C++ kernels, built with contraction off) has a fused multiply-add, so they round alike.
FP_FUSION = False
# reduce_stats_kernel is one program reading 8 bytes per chunk: a wider block, more warps.
REDUCE_BLOCK = 4096
REDUCE_WARPS = 8
# SMs assumed where no CUDA device answers (the interpreter): an H200's, so the CPU tests cut
# tensors into the same chunks a GPU run would.
DEFAULT_SM_COUNT = 132

# Launch plans (device tables + grids) keyed by everything they were built from: device,
# stream, chunking parameters, and every address, size and dtype (plus, for accumulate, the
# offsets), so a hit is always right for the tensors' current addresses. The optimizer calls
# with the same buffers every step, and the caching allocator usually hands the same gradient
# addresses back every micro-batch. 64 entries of ~80 bytes per tensor plus 16 per chunk.
_TABLE_CACHE_SIZE = 64
_table_cache: "OrderedDict[_Key, Tuple[_Key, _Plan]]" = OrderedDict()  # key -> (key, plan)
# Plans used while a CUDA graph was being captured: the graph holds their addresses, so they
# are never evicted (see the module docstring).
_captured: Dict["_Key", "_Plan"] = {}
# Autograd runs post-accumulate-grad hooks on one thread per device: the cache is shared.
_lock = threading.Lock()
# Caller plans (``plan=``): per plan, what its first call validated and read of the tensors
# the plan promises are unchanged (sizes, starts, persistent addresses). Host arrays only, no
# device memory, so evicting one costs one re-validation. Under the same lock.
_TEMPLATE_CACHE_SIZE = 64
_templates: "OrderedDict[_Key, _Template]" = OrderedDict()

# Triton decides at decoration time, when triton_kernels was imported.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_VEC = kernels.VEC.value
_ROW = kernels.ROW.value

# Unbound C methods: one C call per tensor through map(), no Python frame per tensor.
_data_ptr = Tensor.data_ptr
_numel = Tensor.numel
_is_contiguous = Tensor.is_contiguous
_dtype = operator.attrgetter("dtype")
_device = operator.attrgetter("device")


def _addresses_and_dtypes(tensors: List[Tensor]):
    """What a plan hit is keyed by: every tensor's address and dtype. One C++ pass where the
    extension is built (fused_accum._C.addresses_and_dtypes, ~0.05 us per tensor), else two
    Python reads (~0.14 us per tensor each: together more than a 2,048-tensor call's budget)."""
    if _read_in_cpp is not None:
        return _read_in_cpp(tensors)
    return tuple(map(_data_ptr, tensors)), tuple(map(_dtype, tensors))


_read_in_cpp = getattr(ext._C, "addresses_and_dtypes", None)


def unavailable_reason(name: str) -> str:
    """"" when this backend can run (where it may run is decided in backends.availability)."""
    major = int(triton.__version__.split(".")[0])
    return "" if major >= 3 else f"the triton backend needs triton >= 3.0, found {triton.__version__}"


def release_captured_tables() -> int:
    """Forget the tables kept alive for CUDA graphs captured through this backend; call it
    once those graphs are deleted (replaying one afterwards would read freed memory). Returns
    how many were released."""
    with _lock:
        n = len(_captured)
        _captured.clear()
        for arena in _arenas.values():
            arena[1] = 0  # the slices belonged to those graphs' tables
    return n


def clear_table_cache() -> None:
    """Empty the LRU of launch plans and the caller-plan templates (benchmarks changing BLOCK
    or the chunking, tests)."""
    with _lock:
        _table_cache.clear()
        _templates.clear()


# --- tables ----------------------------------------------------------------------------------


class _Tables(NamedTuple):
    tensors: Tensor  # int64 [n_tensors, ROW], see triton_kernels
    chunks: Tensor  # int64 [n_chunks, 2]: (row of the tensor table, first element)
    n_chunks: int
    chunk: int  # elements per chunk (the kernels' run-time ``chunk``)
    host: Optional[Tensor]  # the pinned source of a copy captured into a CUDA graph


class _Template(NamedTuple):
    """What the first call of a caller plan established (see _template): ``None`` in
    ``numels`` means that call had a non-contiguous operand and the plan is not used."""

    numels: Optional[tuple]  # per row
    columns: dict  # accumulate: {"starts": slice starts}; steps: table column -> (addresses, size)
    param_dtypes: Optional[tuple]  # steps whose params are persistent (masters): their dtypes


class _Plan(NamedTuple):
    """Everything a call launches: per dtype group, its key (the dtypes), tables, first
    partial (accumulate's statistics)."""

    launches: Tuple[Tuple[tuple, _Tables, int], ...]
    total_chunks: int


_SM_COUNTS: Dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def chunk_size(total_elements: int, sm_count: int) -> int:
    """Elements per program for a launch over ``total_elements``: the largest power of two
    from BLOCK to MAX_CHUNK_BLOCKS * BLOCK that still gives PROGRAMS_PER_SM programs per SM."""
    target = PROGRAMS_PER_SM * sm_count
    chunk = BLOCK
    while chunk < MAX_CHUNK_BLOCKS * BLOCK and total_elements >= 2 * chunk * target:
        chunk *= 2
    return chunk


def chunk_table(numels, chunk: int) -> np.ndarray:
    """(row, first element) of every chunk of tensors of ``numels`` elements, in order, on the
    host, vectorised. Empty tensors have no chunk. int64, so starts past 2**31 are exact."""
    numels = np.asarray(numels, dtype=np.int64)
    per_tensor = (numels + chunk - 1) // chunk
    rows = np.repeat(np.arange(len(numels), dtype=np.int64), per_tensor)
    first_chunk = np.cumsum(per_tensor) - per_tensor
    starts = (np.arange(len(rows), dtype=np.int64) - first_chunk[rows]) * chunk
    return np.stack([rows, starts], axis=1)


def _aligned(addresses: Dict[int, Tuple[np.ndarray, int]]) -> np.ndarray:
    """Per row: 1 when every address is a multiple of VEC elements of its operand (VEC * element
    size bytes), so the kernels may use vector accesses. The optimizer's flat buffers (64-element
    slices) and freshly allocated tensors are; a view at an odd offset is not. Sizes need not be
    multiples of VEC: the kernels walk the last numel % VEC elements as a scalar tail."""
    ok = None
    for address, element_size in addresses.values():
        this = address % (_VEC * element_size) == 0
        ok = this if ok is None else ok & this
    return ok.astype(np.int64)


def _build(device: torch.device, numel: np.ndarray, index: np.ndarray,
           addresses: Dict[int, Tuple[np.ndarray, int]], capturing: bool) -> _Tables:  # fmt: skip
    """The device tables of one launch: ``addresses`` maps a table column to (addresses,
    element size) for the rows, absent columns stay 0."""
    n = len(numel)
    chunk = chunk_size(int(numel.sum()), _sm_count(device))
    tensors = np.zeros((n, _ROW), dtype=np.int64)
    tensors[:, kernels.NUMEL.value] = numel
    tensors[:, kernels.INDEX.value] = index
    tensors[:, kernels.IS_ALIGNED.value] = _aligned(addresses)
    for column, (address, _) in addresses.items():
        tensors[:, column] = address
    chunks = chunk_table(numel, chunk)
    host = torch.from_numpy(np.concatenate([tensors.reshape(-1), chunks.reshape(-1)]))
    kept = None
    if device.type == "cuda":
        if capturing:
            # no pinned allocation during capture (torch refuses or breaks the capture): a slice
            # of the arena pinned before it, never reused, since every replay copies from it
            host = kept = _arena_slice(device, host)
        else:
            _arena(device)  # pinned now, while no capture is running: a later capture uses it
            host = host.pin_memory()
        try:
            # pinned + non_blocking: the copy is queued on the stream, the host does not wait
            table = host.to(device, non_blocking=True)
        except RuntimeError as e:
            raise RuntimeError(
                "fused_accum triton backend: copying a launch table to the GPU failed"
                + (" during CUDA-graph capture; run the same call once before capturing (a "
                   "warm-up) so the table exists, or use the cuda backend" if capturing else "")
                + f": {e}"
            ) from e  # fmt: skip
    else:
        table = host
    split = tensors.size
    return _Tables(table[:split].view(n, _ROW), table[split:].view(len(chunks), 2), len(chunks), chunk, kept)


# Pinned host memory for the tables first built during a CUDA-graph capture: pinned in eager
# mode (the first eager call on the device), handed out in never-reused slices, emptied by
# release_captured_tables(). 8 MB by default: ~40 plans of 2,048 tensors (~200 KB each).
CAPTURE_ARENA_BYTES = int(float(os.environ.get("FUSED_ACCUM_TRITON_CAPTURE_ARENA_MB", "8")) * 2**20)
_arenas: Dict[torch.device, list] = {}  # device -> [pinned int64 tensor, elements used]


def _arena(device: torch.device) -> list:
    with _lock:
        if device not in _arenas:
            _arenas[device] = [torch.empty(CAPTURE_ARENA_BYTES // 8, dtype=torch.int64, pin_memory=True), 0]
        return _arenas[device]


def _arena_slice(device: torch.device, host: Tensor) -> Tensor:
    """``host`` copied into a fresh slice of the device's capture arena (a CPU copy only)."""
    with _lock:
        arena = _arenas.get(device)
        if arena is None or arena[1] + host.numel() > arena[0].numel():
            raise RuntimeError(
                "fused_accum triton backend: a launch table is needed during CUDA-graph capture "
                + ("before any eager call on this device pinned its capture arena: run the captured "
                   "calls once before capturing (a warm-up)" if arena is None else
                   f"but the {CAPTURE_ARENA_BYTES >> 20} MB capture arena is full: call "
                   "release_captured_tables() after deleting old graphs, or raise "
                   "FUSED_ACCUM_TRITON_CAPTURE_ARENA_MB")
            )  # fmt: skip
        start = arena[1]
        arena[1] += host.numel() + (-host.numel()) % 2  # slices stay 16-byte aligned
    out = arena[0][start : start + host.numel()]
    out.copy_(host)
    return out


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream(device: torch.device) -> int:
    # A table is used on the stream its copy was queued on (and is freed to that stream).
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class _Key:
    """A plan key: a tuple of thousands of ints whose hash is computed once (a dict lookup, an
    LRU move and a store would otherwise hash it again each: ~0.3 ms each at 2,048 tensors)."""

    __slots__ = ("parts", "hash")

    def __init__(self, *parts):
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.parts == other.parts


def _lookup(key: _Key, capturing: bool) -> Optional[_Plan]:
    with _lock:
        if _captured:
            plan = _captured.get(key)
            if plan is not None:
                return plan
        entry = _table_cache.get(key)
        if entry is None:
            return None
        stored, plan = entry
        if capturing:  # the graph keeps these addresses: out of the LRU, for good
            del _table_cache[stored]
            _captured[stored] = plan
        else:
            # by the stored key: found by identity, without comparing thousands of ints again
            # (~0.05 ms at 2,048 tensors)
            _table_cache.move_to_end(stored)
        return plan


def _store(key: _Key, plan: _Plan, capturing: bool) -> None:
    with _lock:
        if capturing:
            _captured[key] = plan
            return
        _table_cache[key] = (key, plan)
        while len(_table_cache) > _TABLE_CACHE_SIZE:
            _table_cache.popitem(last=False)


def _template(key: _Key, make) -> Optional[_Template]:
    """The template of a caller plan, made by ``make()`` (which validates) on its first call;
    None when the plan cannot be used (the call then takes the unplanned path)."""
    with _lock:
        template = _templates.get(key)
        if template is not None:
            _templates.move_to_end(key)
    if template is None:
        template = make()  # outside the lock: validation may take milliseconds
        with _lock:
            _templates[key] = template
            while len(_templates) > _TEMPLATE_CACHE_SIZE:
                _templates.popitem(last=False)
    return template if template.numels is not None else None


def _config() -> tuple:
    return (BLOCK, PROGRAMS_PER_SM, MAX_CHUNK_BLOCKS)


def _dtype_groups(keys: Sequence[tuple]) -> "OrderedDict[tuple, np.ndarray]":
    """Row indices by key (the dtypes a kernel is specialised on), in first-seen order."""
    first = keys[0]
    if keys.count(first) == len(keys):  # the usual case: one dtype per list (a C loop)
        return OrderedDict([(first, np.arange(len(keys), dtype=np.int64))])
    groups: "OrderedDict[tuple, List[int]]" = OrderedDict()
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return OrderedDict((k, np.asarray(v, dtype=np.int64)) for k, v in groups.items())


def _bits(x: float) -> int:
    """The IEEE bits of a double, as the int64 that the kernels bitcast back (Triton would pass
    a Python float as fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


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


# --- accumulate ------------------------------------------------------------------------------


def _accumulate_plan(device, base: int, starts: np.ndarray, ptrs, numels, dtypes, capturing) -> _Plan:
    numel = np.asarray(numels, dtype=np.int64)
    acc_address = base + 4 * np.asarray(starts, dtype=np.int64)
    grad_address = np.asarray(ptrs, dtype=np.int64)
    launches, first = [], 0
    for (dtype,), rows in _dtype_groups([(d,) for d in dtypes]).items():
        tables = _build(device, numel[rows], rows, {
            kernels.ACC.value: (acc_address[rows], 4),
            kernels.GRAD.value: (grad_address[rows], dtype.itemsize),
        }, capturing)  # fmt: skip
        if tables.n_chunks:
            launches.append(((dtype,), tables, first))
            first += tables.n_chunks
    return _Plan(tuple(launches), first)


def _slice_starts(acc: Tensor, offsets: Tensor, grads: List[Tensor], numels: tuple) -> np.ndarray:
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


def _check_dtypes(name: str, xs: Sequence[Tensor], dtypes: tuple) -> None:
    if not set(dtypes) <= set(_FLOAT_DTYPES):
        for i, x in enumerate(xs):
            _check_dtype(name, i, x)


def _accumulate_template(acc: Tensor, offsets: Tensor, grads: List[Tensor]) -> _Template:
    """A plan's first call: every check of an unplanned miss, once."""
    if not all(map(_is_contiguous, grads)):
        return _Template(None, {}, None)  # copies every call: not worth a plan
    numels = tuple(map(_numel, grads))
    return _Template(numels, {"starts": _slice_starts(acc, offsets, grads, numels)}, None)


def accumulate(
    acc: Tensor,
    offsets: Tensor,
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor] = None,
    sumsq: Optional[Tensor] = None,
    plan=None,
) -> None:
    """reference.accumulate, in one launch per gradient dtype (+1 for found_inf/sumsq).

    ``plan``: optional, any hashable the caller never reuses for other parameters. It promises
    that in every call with this plan ``grads[i]`` is a gradient of the same parameter as in the
    plan's first call: the same size and strides (autograd's layout contract gives a parameter's
    gradients its strides); only its address and dtype may change. ``acc`` and ``offsets`` are
    checked by value as usual. Then a call reads two things per gradient (address, dtype)
    instead of four."""
    if (acc.dtype != torch.float32 or acc.dim() != 1 or not acc.is_contiguous()
            or offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.device.type != "cpu"
            or len(offsets) != len(grads) or not grads):  # fmt: skip
        reference.slice_starts(acc, offsets, grads)  # raises with the reason, or nothing to do
        if not grads:
            return
    device = _device_of(acc)
    _check_scalar("found_inf", found_inf, device)
    _check_scalar("sumsq", sumsq, device)
    keep: list = []
    capturing = _capturing(device)
    template = None
    if plan is not None:
        # acc and offsets by value (cheap: two tensors), the gradients' sizes from the plan
        where = _Key("accumulate", plan, device, acc.data_ptr(), acc.numel(), offsets.numpy().tobytes())
        template = _template(where, lambda: _accumulate_template(acc, offsets, grads))
    if template is not None:
        key = _Key(where, _stream(device), _config(), _addresses_and_dtypes(grads))
        launch = _lookup(key, capturing)
        if launch is None:
            ptrs, dtypes = tuple(map(_data_ptr, grads)), tuple(map(_dtype, grads))
            _check_dtypes("grads", grads, dtypes)
            launch = _accumulate_plan(device, acc.data_ptr(), template.columns["starts"], ptrs,
                                      template.numels, dtypes, capturing)  # fmt: skip
            _store(key, launch, capturing)
    else:
        if not all(map(_is_contiguous, grads)):
            grads = [_readable(g, keep) for g in grads]
        ptrs = tuple(map(_data_ptr, grads))
        numels = tuple(map(_numel, grads))
        dtypes = tuple(map(_dtype, grads))
        key = _Key("accumulate", device, _stream(device), _config(), acc.data_ptr(), acc.numel(),
                   offsets.numpy().tobytes(), ptrs, numels, dtypes)  # fmt: skip
        launch = _lookup(key, capturing)
        if launch is None:
            # a miss: check everything (a hit's addresses, sizes and dtypes passed these checks)
            starts = _slice_starts(acc, offsets, grads, numels)
            _check_dtypes("grads", grads, dtypes)
            launch = _accumulate_plan(device, acc.data_ptr(), starts, ptrs, numels, dtypes, capturing)
            _store(key, launch, capturing)
    if launch.total_chunks == 0:
        return
    stats = found_inf is not None or sumsq is not None
    # row 0: per-chunk sums of squares, row 1: per-chunk non-finite flags
    partials = torch.empty((2, launch.total_chunks), dtype=torch.float32, device=device) if stats else None
    with _on(device):
        for (dtype,), tables, first in launch.launches:
            if stats:
                part_sq, part_bad = partials[0], partials[1]
            else:  # never dereferenced (STATS=False), any tensor will do
                part_sq = part_bad = tables.chunks
            kernels.accumulate_kernel[(tables.n_chunks,)](
                tables.chunks, tables.tensors, part_sq, part_bad, first, float(alpha), tables.chunk,
                GRAD_DTYPE=_TL_DTYPE[dtype], OVERWRITE=bool(overwrite), STATS=stats,
                BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
            )  # fmt: skip
        if stats:
            kernels.reduce_stats_kernel[(1,)](
                partials[0], partials[1], launch.total_chunks,
                sumsq if sumsq is not None else partials, found_inf if found_inf is not None else partials,
                HAS_SUMSQ=sumsq is not None, HAS_FOUND_INF=found_inf is not None,
                BLOCK=REDUCE_BLOCK, num_warps=REDUCE_WARPS, enable_fp_fusion=FP_FUSION,
            )  # fmt: skip
    del keep  # the copies may go: the launches are queued on the stream in order


# --- optimizer steps -------------------------------------------------------------------------

# Table columns of the optimizer-state lists, in the order the step ops pass them.
_STATE_COLUMNS = (kernels.STATE0.value, kernels.STATE1.value, kernels.STATE2.value)


def _validate_step(name, params, states, accs, lp_params, grads, device) -> None:
    """Every per-tensor check of a step (on a plan miss only, see _step): over whole lists first
    (one C call per tensor and check), and only when that fails tensor by tensor, for the
    message (the loop costs ~10 us per tensor: 20 ms for 2,048)."""
    numels = tuple(map(_numel, accs))
    fp32_lists = [accs, *states.values()]
    float_lists = [xs for xs in (params, lp_params, grads) if xs]
    ok = all(
        set(map(_dtype, xs)) == {torch.float32} and set(map(Tensor.dim, xs)) == {1}
        and all(map(_is_contiguous, xs)) and tuple(map(_numel, xs)) == numels
        for xs in fp32_lists
    ) and all(
        set(map(_dtype, xs)) <= set(_FLOAT_DTYPES) and tuple(map(_numel, xs)) == numels
        for xs in float_lists
    ) and all(set(map(_device, xs)) == {device} for xs in fp32_lists + float_lists)  # fmt: skip
    if ok:
        return
    for i in range(len(params)):
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


def _step_plan(device, numels, columns, keys, capturing) -> _Plan:
    """``columns``: table column -> (addresses, element sizes per row or one for all)."""
    numel = np.asarray(numels, dtype=np.int64)
    launches = []
    for key, rows in _dtype_groups(keys).items():
        addresses = {}
        for column, (address, element_size) in columns.items():
            size = element_size if isinstance(element_size, int) else element_size(key)
            addresses[column] = (address[rows], size)
        tables = _build(device, numel[rows], rows, addresses, capturing)
        if tables.n_chunks:
            launches.append((key, tables, 0))
    return _Plan(tuple(launches), sum(t.n_chunks for _, t, _ in launches))


# The lists a planned step reads every call: their table column and their place in a dtype
# group's key (param, lp, grad dtypes).
_READ_COLUMNS = {"params": (kernels.PARAM.value, 0), "lp_params": (kernels.LP.value, 1),
                 "grads": (kernels.GRAD.value, 2)}  # fmt: skip


def _step_template(params, states, accs, lp_params, grads, device, name) -> _Template:
    """A step plan's first call: every check of an unplanned miss, once, and the addresses of
    the lists the plan keeps (accs, states, and params when they are masters)."""
    _validate_step(name, params, states, accs, lp_params, grads, device)
    if not all(all(map(_is_contiguous, xs)) for xs in (params, lp_params, grads)):
        return _Template(None, {}, None)  # copies every call: not worth a plan
    columns = {kernels.ACC.value: (np.asarray(tuple(map(_data_ptr, accs)), dtype=np.int64), 4)}
    for column, xs in zip(_STATE_COLUMNS, states.values()):
        columns[column] = (np.asarray(tuple(map(_data_ptr, xs)), dtype=np.int64), 4)
    param_dtypes = None
    if lp_params:  # params are the optimizer's masters: kept by the plan
        param_dtypes = tuple(map(_dtype, params))
        columns[kernels.PARAM.value] = (np.asarray(tuple(map(_data_ptr, params)), dtype=np.int64),
                                        lambda k: k[0].itemsize)  # fmt: skip
    return _Template(tuple(map(_numel, accs)), columns, param_dtypes)


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
    plan=None,
) -> None:
    """The launcher shared by the three step ops: validate, group by dtypes, launch.

    ``states`` are the optimizer-state lists by argument name (0 to 3 of them, fp32 like
    accs, in table columns STATE0..STATE2); ``scalars`` and ``flags`` are the kernel's own
    hyper-parameters and constexpr switches. Without ``plan``, per call each tensor's address
    is read, with the sizes of accs and grads, the dtypes of params, lp_params and grads and
    their contiguity; a miss of the table cache checks everything else.

    ``plan``: optional, any hashable the caller never reuses for other parameters. It promises
    that in every call with this plan the lists hold the same parameters in the same order, and
    that ``accs``, the state lists and, when ``lp_params`` are given, ``params`` (the masters)
    are the same tensors, each at a fixed address relative to the first of its list (views of
    one flat buffer that moves, if ever, as a whole; the first addresses are checked each
    call). What a model or a backward owns is read each call, address and dtype: ``lp_params``,
    or ``params`` when there are none, and ``grads``; their sizes and strides are promised.
    """
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
    if lr.dtype not in (torch.float64, torch.float32) or lr.numel() != 1 or lr.device != device:
        raise ValueError(
            f"lr must be a one-element float64 or float32 tensor on {device}, "
            f"got {lr.dtype} with {lr.numel()} elements on {lr.device}"
        )
    # The kernels read a double (torch's fused optimizers take lr as one): an fp32 lr is widened
    # on its device, exactly (no host sync, capturable), rather than compiling a second variant.
    lr = lr if lr.dtype == torch.float64 else lr.to(torch.float64)
    _check_scalar("coef", coef, device)
    _check_scalar("found_inf", found_inf, device)
    # exactly one step count per tensor, as the C++ binding requires (a longer tensor would
    # mean the caller's lists and counts are out of step)
    if steps is not None and (steps.dtype != torch.float32 or steps.dim() != 1 or steps.numel() != n
                              or steps.device != device):  # fmt: skip
        raise ValueError(
            f"{name}: steps must be a 1-D float32 tensor of {n} step counts (one per param) on "
            f"{device}, got {steps.dtype} of shape {tuple(steps.shape)} on {steps.device}"
        )

    keep: list = []
    write_back: list = []
    capturing = _capturing(device)
    template = None
    if plan is not None:
        firsts = [accs[0].data_ptr(), *(xs[0].data_ptr() for xs in states.values())]
        if lp_params:
            firsts.append(params[0].data_ptr())
        where = _Key(name, plan, device, tuple(states), n, bool(lp_params), bool(grads), *firsts)
        template = _template(where, lambda: _step_template(params, states, accs, lp_params, grads, device, name))
    if template is not None:
        # read: what the model or the backward owns (see the docstring)
        read = {"lp_params": lp_params} if lp_params else {"params": params}
        if grads:
            read["grads"] = grads
        ptrs = [tuple(map(_data_ptr, xs)) for xs in read.values()]
        dtypes = [tuple(map(_dtype, xs)) for xs in read.values()]
        key = _Key(where, _stream(device), _config(), *ptrs, *dtypes)
        launch = _lookup(key, capturing)
        if launch is None:
            for what, xs, ds in zip(read, read.values(), dtypes):
                _check_dtypes(what, xs, ds)
            read_dtypes = dict(zip(read, dtypes))
            columns = dict(template.columns)
            for what, addresses in zip(read, ptrs):
                column, position = _READ_COLUMNS[what]
                columns[column] = (np.asarray(addresses, dtype=np.int64), lambda k, p=position: k[p].itemsize)
            param_dtypes = template.param_dtypes or read_dtypes["params"]
            keys = list(zip(param_dtypes, read_dtypes.get("lp_params") or [torch.float32] * n,
                            read_dtypes.get("grads") or [torch.float32] * n))  # fmt: skip
            launch = _step_plan(device, template.numels, columns, keys, capturing)
            _store(key, launch, capturing)
    else:
        if not all(map(_is_contiguous, params)):
            params = [_writable(p, write_back) for p in params]
        if lp_params and not all(map(_is_contiguous, lp_params)):
            lp_params = [_writable(p, write_back) for p in lp_params]
        if grads and not all(map(_is_contiguous, grads)):
            grads = [_readable(g, keep) for g in grads]
        state_lists = list(states.values())
        ptrs = [tuple(map(_data_ptr, xs)) for xs in (accs, params, lp_params, grads, *state_lists)]
        numels = tuple(map(_numel, accs))
        dtypes = [tuple(map(_dtype, xs)) for xs in (params, lp_params, grads)]
        # the fused gradients are new tensors every window: their sizes are in the key; params,
        # lp_params and the state lists are checked against accs on a miss, and keep their size
        # while their address is unchanged
        grad_numels = tuple(map(_numel, grads))
        key = _Key(name, device, _stream(device), _config(), tuple(states), numels, *ptrs, *dtypes, grad_numels)
        launch = _lookup(key, capturing)
        if launch is None:
            _validate_step(name, params, states, accs, lp_params, grads, device)
            param_dtypes, lp_dtypes, grad_dtypes = dtypes
            keys = list(zip(
                param_dtypes,
                lp_dtypes or [torch.float32] * n,  # placeholder: not read
                grad_dtypes or [torch.float32] * n,  # placeholder: not read
            ))  # fmt: skip
            columns = {
                kernels.ACC.value: (np.asarray(ptrs[0], dtype=np.int64), 4),
                kernels.PARAM.value: (np.asarray(ptrs[1], dtype=np.int64), lambda k: k[0].itemsize),
            }
            if lp_params:
                columns[kernels.LP.value] = (np.asarray(ptrs[2], dtype=np.int64), lambda k: k[1].itemsize)
            if grads:
                columns[kernels.GRAD.value] = (np.asarray(ptrs[3], dtype=np.int64), lambda k: k[2].itemsize)
            for column, addresses in zip(_STATE_COLUMNS, ptrs[4:]):
                columns[column] = (np.asarray(addresses, dtype=np.int64), 4)
            launch = _step_plan(device, numels, columns, keys, capturing)
            _store(key, launch, capturing)

    steps_arg = () if steps is None else (steps.contiguous(),)
    with _on(device):
        for (param_dtype, lp_dtype, grad_dtype), tables, _ in launch.launches:
            kernel[(tables.n_chunks,)](
                tables.chunks, tables.tensors, *steps_arg, lr, coef,
                found_inf if found_inf is not None else coef,  # not read unless HAS_FOUND_INF
                tables.chunk, float(grad_alpha), *scalars,
                PARAM_DTYPE=_TL_DTYPE[param_dtype], LP_DTYPE=_TL_DTYPE[lp_dtype],
                GRAD_DTYPE=_TL_DTYPE[grad_dtype], HAS_LP=bool(lp_params), FUSED=bool(grads),
                GRADS_OVERWRITE=bool(grads_overwrite), HAS_FOUND_INF=found_inf is not None,
                **flags, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION,
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
    plan=None,
) -> None:
    """reference.sgd_step in one launch per dtype group (``plan``: see _step)."""
    states = OrderedDict(momentum_bufs=momentum_bufs) if momentum != 0 else OrderedDict()
    _step(
        kernels.sgd_kernel, "sgd_step", params, states, accs, steps, lr, coef,
        lp_params, grads, grad_alpha, grads_overwrite, found_inf,
        scalars=(float(momentum), 1.0 - float(dampening), float(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize), HAS_WEIGHT_DECAY=weight_decay != 0,
                   HAS_MOMENTUM=momentum != 0, NESTEROV=bool(nesterov)),
        plan=plan,
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
    max_exp_avg_sqs: Sequence[Tensor] = (),
    plan=None,
) -> None:
    """reference.adam_step (Adam / AdamW; amsgrad with a non-empty ``max_exp_avg_sqs``) in
    one launch per dtype group (``plan``: see _step)."""
    states = OrderedDict(exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if max_exp_avg_sqs:
        states["max_exp_avg_sqs"] = max_exp_avg_sqs
    _step(
        kernels.adam_kernel, "adam_step", params, states, accs, steps, lr, coef,
        lp_params, grads, grad_alpha, grads_overwrite, found_inf,
        scalars=(_bits(beta1), _bits(beta2), _bits(weight_decay), float(beta1), float(beta2),
                 1.0 - float(beta1), 1.0 - float(beta2), float(eps), float(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize), HAS_WEIGHT_DECAY=weight_decay != 0,
                   DECOUPLED=bool(decoupled), AMSGRAD=bool(max_exp_avg_sqs)),
        plan=plan,
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
    plan=None,
) -> None:
    """reference.lion_step in one launch per dtype group (``steps`` is unused, as there;
    ``plan``: see _step)."""
    del steps
    _step(
        kernels.lion_kernel, "lion_step", params, OrderedDict(exp_avgs=exp_avgs), accs, None, lr, coef,
        lp_params, grads, grad_alpha, grads_overwrite, found_inf,
        scalars=(float(beta1), float(beta2), 1.0 - float(beta1), 1.0 - float(beta2),
                 _bits(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize)),
        plan=plan,
    )  # fmt: skip

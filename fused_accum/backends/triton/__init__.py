"""Triton backend: the four ops of :mod:`fused_accum.backends.reference`, same signatures and
contracts, each in one launch per dtype group (plus one tiny launch folding the norm/non-finite
partials when those are asked for): any number of tensors, from 1 element to billions, goes
through a device table of raw addresses and sizes rather than one launch per tensor.

It is chosen for CUDA tensors when the C++/CUDA extension is absent, and runs on CPU tensors
under ``TRITON_INTERPRET=1`` (set before triton is imported) as a test of the kernels: nothing
here assumes CUDA. The package, one job per module:

- ``kernels``: the ``@triton.jit`` kernels, the math and only the math;
- ``tables``: the launch tables laid out on the host (columns, chunks, dtype groups);
- ``plans``: what a call is keyed by, what its checks established, the columns of its tables;
- ``checks``: what the ops accept;
- ``wgrad``: the fused weight-gradient GEMM (its kernel and launch);
- this ``__init__``: the ops themselves, their one launch path, and the host state they share
  (the plan cache, the CUDA-graph registry and capture arena, the launch configuration). That
  state lives here, in the module :func:`fused_accum.backends.get` returns, so that whoever
  reads or patches ``fused_accum.backends.triton._table_cache`` or ``.BLOCK`` reaches the one
  the launches use.

Host cost. A call reads, per tensor, only what can change between calls, builds a key from it
and looks the launch plan up; only a miss validates everything and builds the tables, with
numpy over whole columns rather than per row. Each such read costs ~0.14 us per tensor on the
development CPU (0.28 ms for 2,048 tensors), so a step without a plan, reading address, size,
dtype and contiguity of 5 lists of 2,048, takes ~6 ms. A caller that passes ``plan=`` (see
:func:`accumulate` and :func:`_step`) promises which tensors stay the same from call to call;
then only the gradients and the model's parameters are read (address and dtype), which is what
meets issue 10's host-time goals. A call without a plan takes the same path as a plan of its
own (:mod:`.plans`). ``benchmarks/triton_host.py`` measures both with the kernels stubbed.

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
import os
import struct
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

import triton  # an ImportError here makes the backend unavailable (see backends._load)
import triton.language as tl

from .. import reference
from . import checks, kernels, plans, tables
from .tables import chunk_table  # noqa: F401  (part of this backend's face: tests, benchmarks)

# --- launch configuration ------------------------------------------------------------------------
# Read at each call (benchmarks/triton_sweep.py sets them here, then clears the cache).

# One program owns a chunk of one tensor, walked in BLOCK steps. BLOCK = 1024 with 4 warps is
# 8 elements per thread per tensor, two vector accesses of VEC = 4 (16 bytes of fp32, 8 of
# bf16; see kernels): 8 to 10 independent loads in flight per thread in a fused step.
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

# --- the host state the ops share ------------------------------------------------------------------

# Launch plans (device tables + grids) keyed by everything they were built from: device,
# stream, chunking parameters, and every address, size and dtype (plus, for accumulate, the
# offsets), so a hit is always right for the tensors' current addresses. The optimizer calls
# with the same buffers every step, and the caching allocator usually hands the same gradient
# addresses back every micro-batch. 64 entries of ~80 bytes per tensor plus 16 per chunk.
_TABLE_CACHE_SIZE = 64
_table_cache: "OrderedDict[plans.Key, tuple]" = OrderedDict()  # key -> (key, plan)
# Plans used while a CUDA graph was being captured: the graph holds their addresses, so they
# are never evicted (see the module docstring).
_captured: Dict[plans.Key, plans.Plan] = {}
# Autograd runs post-accumulate-grad hooks on one thread per device: the cache is shared.
_lock = threading.Lock()
# Caller plans (``plan=``): per plan, what its first call validated and read of the tensors
# the plan promises are unchanged (sizes, starts, persistent addresses). Host arrays only, no
# device memory, so evicting one costs one re-validation. Under the same lock.
_TEMPLATE_CACHE_SIZE = 64
_templates: "OrderedDict[plans.Key, plans.Template]" = OrderedDict()
# Pinned host memory for the tables first built during a CUDA-graph capture: pinned in eager
# mode (the first eager call on the device), handed out in never-reused slices, emptied by
# release_captured_tables(). 8 MB by default: ~40 plans of 2,048 tensors (~200 KB each).
CAPTURE_ARENA_BYTES = int(float(os.environ.get("FUSED_ACCUM_TRITON_CAPTURE_ARENA_MB", "8")) * 2**20)
_arenas: Dict[torch.device, list] = {}  # device -> [pinned int64 tensor, elements used]
_SM_COUNTS: Dict[int, int] = {}

# The names this module's tests use for the plan types (their home is .plans).
_Key, _Plan = plans.Key, plans.Plan

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def unavailable_reason(name: str) -> str:
    """ "" when this backend can run (where it may run is decided in backends.availability)."""
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


# --- the plan cache ------------------------------------------------------------------------------


def _lookup(key: plans.Key, capturing: bool) -> Optional[plans.Plan]:
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


def _store(key: plans.Key, plan: plans.Plan, capturing: bool) -> None:
    with _lock:
        if capturing:
            _captured[key] = plan
            return
        _table_cache[key] = (key, plan)
        while len(_table_cache) > _TABLE_CACHE_SIZE:
            _table_cache.popitem(last=False)


def _template(key: plans.Key, make) -> Optional[plans.Template]:
    """The template of a caller plan, made by ``make()`` (which validates) on its first call;
    None when the plan cannot be used (the call then goes as one without a plan)."""
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


# --- building a plan's tables on the device --------------------------------------------------------


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


# The names this module's tests use for the alignment rule (its home is .tables).
_aligned = tables.aligned


def _build(
    device: torch.device, numel: np.ndarray, index: np.ndarray, addresses: Dict[int, tuple], capturing: bool
) -> tables.Tables:
    """The device tables of one launch: ``addresses`` maps a table column to (addresses,
    element size) for the rows, absent columns stay 0."""
    n = len(numel)
    chunk = chunk_size(int(numel.sum()), _sm_count(device))
    host, n_chunks = tables.host_tables(numel, index, addresses, chunk)
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
                + (
                    " during CUDA-graph capture; run the same call once before capturing (a "
                    "warm-up) so the table exists, or use the cuda backend"
                    if capturing
                    else ""
                )
                + f": {e}"
            ) from e
    else:
        table = host
    split = n * tables.ROW
    return tables.Tables(table[:split].view(n, tables.ROW), table[split:].view(n_chunks, 2), n_chunks, chunk, kept)


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
                + (
                    "before any eager call on this device pinned its capture arena: run the captured "
                    "calls once before capturing (a warm-up)"
                    if arena is None
                    else f"but the {CAPTURE_ARENA_BYTES >> 20} MB capture arena is full: call "
                    "release_captured_tables() after deleting old graphs, or raise "
                    "FUSED_ACCUM_TRITON_CAPTURE_ARENA_MB"
                )
            )
        start = arena[1]
        arena[1] += host.numel() + (-host.numel()) % 2  # slices stay 16-byte aligned
    out = arena[0][start : start + host.numel()]
    out.copy_(host)
    return out


def _make_plan(device, numels, columns: tables.Columns, keys: Sequence[tuple], capturing: bool) -> plans.Plan:
    """A call's launch plan: the tables of each dtype group (``keys[i]``: row i's dtypes) that
    has anything to do."""
    launches, first = [], 0
    for key, numel, rows, addresses in tables.groups(numels, columns, keys):
        built = _build(device, numel, rows, addresses, capturing)
        if built.n_chunks:
            launches.append((key, built, first))
            first += built.n_chunks
    return plans.Plan(tuple(launches), first)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream(device: torch.device) -> int:
    # A table is used on the stream its copy was queued on (and is freed to that stream).
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not on the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _bits(x: float) -> int:
    """The IEEE bits of a double, as the int64 that the kernels bitcast back (Triton would pass
    a Python float as fp32)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


# --- accumulate ------------------------------------------------------------------------------


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
    if not checks.accumulate_is_simple(acc, offsets, grads):
        reference.slice_starts(acc, offsets, grads)  # raises with the reason, or nothing to do
        if not grads:
            return
    device = checks.device_of(acc)
    checks.check_scalar("found_inf", found_inf, device)
    checks.check_scalar("sumsq", sumsq, device)
    keep: list = []
    capturing = _capturing(device)
    template = None
    if plan is not None:
        where = plans.accumulate_where(plan, device, acc, offsets)
        template = _template(where, lambda: plans.accumulate_template(acc, offsets, grads))
    if template is None:  # no plan (or an unusable one): this call is a plan of its own
        grads = checks.readable(grads, keep)
        where = plans.accumulate_where(None, device, acc, offsets, tuple(map(plans.numel, grads)))
    key = plans.Key(where, _stream(device), _config(), plans.addresses_and_dtypes(grads))
    launch = _lookup(key, capturing)
    if launch is None:
        if template is None:  # a call without a plan is checked on a miss only
            template = plans.accumulate_template(acc, offsets, grads)
        ptrs, dtypes = tuple(map(plans.data_ptr, grads)), tuple(map(plans.dtype, grads))
        checks.check_dtypes("grads", grads, dtypes)
        columns = plans.accumulate_columns(acc, template, ptrs)
        launch = _make_plan(device, template.numels, columns, [(d,) for d in dtypes], capturing)
        _store(key, launch, capturing)
    if launch.total_chunks == 0:
        return
    stats = found_inf is not None or sumsq is not None
    # row 0: per-chunk sums of squares, row 1: per-chunk non-finite flags
    partials = torch.empty((2, launch.total_chunks), dtype=torch.float32, device=device) if stats else None
    with _on(device):
        for (dtype,), group_tables, first in launch.launches:
            if stats:
                part_sq, part_bad = partials[0], partials[1]
            else:  # never dereferenced (STATS=False), any tensor will do
                part_sq = part_bad = group_tables.chunks
            kernels.accumulate_kernel[(group_tables.n_chunks,)](
                group_tables.chunks,
                group_tables.tensors,
                part_sq,
                part_bad,
                first,
                float(alpha),
                group_tables.chunk,
                GRAD_DTYPE=_TL_DTYPE[dtype],
                OVERWRITE=bool(overwrite),
                STATS=stats,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
                enable_fp_fusion=FP_FUSION,
            )
        if stats:
            kernels.reduce_stats_kernel[(1,)](
                partials[0],
                partials[1],
                launch.total_chunks,
                sumsq if sumsq is not None else partials,
                found_inf if found_inf is not None else partials,
                HAS_SUMSQ=sumsq is not None,
                HAS_FOUND_INF=found_inf is not None,
                BLOCK=REDUCE_BLOCK,
                num_warps=REDUCE_WARPS,
                enable_fp_fusion=FP_FUSION,
            )
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
    plan=None,
) -> None:
    """The launcher shared by the three step ops: check, look the plan up, launch.

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
    checks.step_lengths(name, params, states, accs, lp_params, grads)
    n = len(params)
    if n == 0:
        return
    device = checks.device_of(accs[0])
    checks.step_scalars(name, n, steps, lr, coef, found_inf, device)
    # The kernels read a double (torch's fused optimizers take lr as one): an fp32 lr is widened
    # on its device, exactly (no host sync, capturable), rather than compiling a second variant.
    lr = lr if lr.dtype == torch.float64 else lr.to(torch.float64)

    keep: list = []
    write_back: list = []
    capturing = _capturing(device)
    template = None
    if plan is not None:
        where = plans.step_where(name, plan, device, params, states, accs, lp_params, grads)
        template = _template(where, lambda: plans.step_template(name, params, states, accs, lp_params, grads, device))
    if template is None:  # no plan (or an unusable one): this call is a plan of its own
        params = checks.writable(params, write_back)
        lp_params = checks.writable(lp_params, write_back)
        grads = checks.readable(grads, keep)
        where = plans.unplanned_step_where(name, device, params, states, accs, lp_params, grads)
    read = plans.step_read(params, lp_params, grads)
    ptrs = [tuple(map(plans.data_ptr, xs)) for xs in read.values()]
    dtypes = [tuple(map(plans.dtype, xs)) for xs in read.values()]
    key = plans.Key(where, _stream(device), _config(), *ptrs, *dtypes)
    launch = _lookup(key, capturing)
    if launch is None:
        if template is None:  # a call without a plan is checked on a miss only
            template = plans.step_template(name, params, states, accs, lp_params, grads, device)
        for what, xs, ds in zip(read, read.values(), dtypes):
            checks.check_dtypes(what, xs, ds)
        columns, keys = plans.step_columns(template, read, ptrs, dtypes)
        launch = _make_plan(device, template.numels, columns, keys, capturing)
        _store(key, launch, capturing)

    steps_arg = () if steps is None else (steps.contiguous(),)
    with _on(device):
        for (param_dtype, lp_dtype, grad_dtype), group_tables, _ in launch.launches:
            kernel[(group_tables.n_chunks,)](
                group_tables.chunks,
                group_tables.tensors,
                *steps_arg,
                lr,
                coef,
                found_inf if found_inf is not None else coef,  # not read unless HAS_FOUND_INF
                group_tables.chunk,
                float(grad_alpha),
                *scalars,
                PARAM_DTYPE=_TL_DTYPE[param_dtype],
                LP_DTYPE=_TL_DTYPE[lp_dtype],
                GRAD_DTYPE=_TL_DTYPE[grad_dtype],
                HAS_LP=bool(lp_params),
                FUSED=bool(grads),
                GRADS_OVERWRITE=bool(grads_overwrite),
                HAS_FOUND_INF=found_inf is not None,
                **flags,
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
                enable_fp_fusion=FP_FUSION,
            )
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
        kernels.sgd_kernel,
        "sgd_step",
        params,
        states,
        accs,
        steps,
        lr,
        coef,
        lp_params,
        grads,
        grad_alpha,
        grads_overwrite,
        found_inf,
        scalars=(float(momentum), 1.0 - float(dampening), float(weight_decay)),
        flags=dict(
            MAXIMIZE=bool(maximize),
            HAS_WEIGHT_DECAY=weight_decay != 0,
            HAS_MOMENTUM=momentum != 0,
            NESTEROV=bool(nesterov),
        ),
        plan=plan,
    )


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
        kernels.adam_kernel,
        "adam_step",
        params,
        states,
        accs,
        steps,
        lr,
        coef,
        lp_params,
        grads,
        grad_alpha,
        grads_overwrite,
        found_inf,
        scalars=(
            _bits(beta1),
            _bits(beta2),
            _bits(weight_decay),
            float(beta1),
            float(beta2),
            1.0 - float(beta1),
            1.0 - float(beta2),
            float(eps),
            float(weight_decay),
        ),
        flags=dict(
            MAXIMIZE=bool(maximize),
            HAS_WEIGHT_DECAY=weight_decay != 0,
            DECOUPLED=bool(decoupled),
            AMSGRAD=bool(max_exp_avg_sqs),
        ),
        plan=plan,
    )


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
        kernels.lion_kernel,
        "lion_step",
        params,
        OrderedDict(exp_avgs=exp_avgs),
        accs,
        None,
        lr,
        coef,
        lp_params,
        grads,
        grad_alpha,
        grads_overwrite,
        found_inf,
        scalars=(float(beta1), float(beta2), 1.0 - float(beta1), 1.0 - float(beta2), _bits(weight_decay)),
        flags=dict(MAXIMIZE=bool(maximize)),
        plan=plan,
    )

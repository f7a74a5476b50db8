"""Triton backend: the ops of :mod:`fused_accum.backends.reference`, same signatures and
contracts, each in one launch per dtype group (plus one tiny launch folding the norm/non-finite
partials when those are asked for): any number of tensors, from 1 element to past 2**31, goes
through a device table of raw addresses and sizes rather than one launch per tensor.

It is chosen for CUDA tensors when the C++/CUDA extension is absent, and runs on CPU tensors
under ``TRITON_INTERPRET=1`` (set before triton is imported) as a test of the kernels: nothing
here assumes CUDA. The package, one job per module:

- ``kernels``: the ``@triton.jit`` kernels, the math and only the math;
- ``tables``: the launch tables laid out on the host (columns, chunks, dtype groups);
- ``plans``: what a call is keyed by, what its checks established, the columns of its tables;
- ``checks``: what the ops accept;
- ``wgrad``: the fused weight-gradient GEMM (its kernel and launch);
- ``launch``: the ops themselves and their one launch path (re-exported here);
- this ``__init__``: the host state the ops share (the plan cache, the CUDA-graph registry and
  capture arena, the launch configuration) and the building of a plan's device tables. That
  state lives here, in the module :func:`fused_accum.backends.get` returns, and ``launch``
  reads it from here at each call, so that whoever reads or patches
  ``fused_accum.backends.triton._table_cache`` or ``.BLOCK`` reaches the one the launches use.

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

import os
import threading
from collections import OrderedDict
from typing import Dict, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

import triton  # an ImportError here makes the backend unavailable (see backends._load)

from . import kernels, plans, tables, updates  # noqa: F401  (kernels, updates: tests and benchmarks reach them here)
from .fold import fold_pieces  # noqa: F401  (the op)
from .launch import accumulate, step  # noqa: F401  (the ops)
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
# Warps per program of a step kernel variant (step_num_warps): NUM_WARPS, but twice that for
# an update rule that asks for it (kernels.Update.wide_in_place_16bit) on 16-bit params stepped
# in place (no master, no remainder).


def step_num_warps(op_name: str, param_bits: int, has_lp: bool, has_rem: bool) -> int:
    """The warps a step kernel variant is launched with (``op_name``: the step op's, whose
    update rule is ``updates.UPDATES[op_name]``; ``param_bits``: 16 or 32). triton 3.6 (the GPU
    machine's) compiles Adam's update on 16-bit params without a master (amsgrad or not) at
    BLOCK 1024 and 4 warps to 48 registers with one or two saved around the out-of-line IEEE
    div/sqrt calls inside the main loop: 4 + 4 B of spill stores and loads per iteration
    (amsgrad 8 + 36). At 8 warps (40 registers) or BLOCK 512 it has no stack; 8 warps keeps
    BLOCK, so every variant cuts the same chunks. triton 3.9 spills in neither shape; the other
    variants, the remainder ones included, in neither version (scripts/check_triton_spills.py
    compiles each variant at the shape this returns)."""
    if updates.UPDATES[op_name].wide_in_place_16bit and param_bits == 16 and not has_lp and not has_rem:
        return 2 * NUM_WARPS
    return NUM_WARPS


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

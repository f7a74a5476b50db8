"""The ops: argument checks, the plan looked up (or built) in the package's cache, and
the launches. :func:`accumulate` has its own launcher, and every step op the one :func:`step`
(the generic step kernel with the op's update rule). Each takes the backend contract of
:mod:`fused_accum.backends.reference` (a step: the op and its records ``t``, ``s``, ``h``
declared in :mod:`fused_accum.ops`), plus ``plan=``.

What the package (``__init__``) owns, the plan cache, the CUDA-graph registry and arena and the
launch configuration (``BLOCK``, ``NUM_WARPS``...), is read from it at call time through
``_pkg``, never imported by name: tests and benchmarks patch those names on the package module
(``backends.get("triton")``), and a copy bound here at import would keep launching with the old
value. The package re-exports the ops, so callers find them where they always were.
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from typing import TYPE_CHECKING, List, Optional

import torch
from torch import Tensor

import triton.language as tl

from .. import reference
from . import checks, kernels, plans, updates

if TYPE_CHECKING:  # the records of the declarations (fused_accum.ops imports the backends)
    from ...ops import StepOp, StepTensors

# The package module itself, partly initialised while it imports this one; only its attributes
# at call time are read, by which point it is complete.
_pkg = sys.modules[__package__]

# (int16: the remainders, in the LP column of a step with HAS_REM)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32, torch.int16: tl.int16}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _stream(device: torch.device) -> int:
    # A table is used on the stream its copy was queued on (and is freed to that stream).
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not on the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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
        template = _pkg._template(where, lambda: plans.accumulate_template(acc, offsets, grads))
    if template is None:  # no plan (or an unusable one): this call is a plan of its own
        grads = checks.readable(grads, keep)
        where = plans.accumulate_where(None, device, acc, offsets, tuple(map(plans.numel, grads)))
    key = plans.Key(where, _stream(device), _pkg._config(), plans.addresses_and_dtypes(grads))
    launch = _pkg._lookup(key, capturing)
    if launch is None:
        if template is None:  # a call without a plan is checked on a miss only
            template = plans.accumulate_template(acc, offsets, grads)
        ptrs, dtypes = tuple(map(plans.data_ptr, grads)), tuple(map(plans.dtype, grads))
        checks.check_dtypes("grads", grads, dtypes)
        columns = plans.accumulate_columns(acc, template, ptrs)
        launch = _pkg._make_plan(device, template.numels, columns, [(d,) for d in dtypes], capturing)
        _pkg._store(key, launch, capturing)
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
                BLOCK=_pkg.BLOCK,
                num_warps=_pkg.NUM_WARPS,
                enable_fp_fusion=_pkg.FP_FUSION,
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
                BLOCK=_pkg.REDUCE_BLOCK,
                num_warps=_pkg.REDUCE_WARPS,
                enable_fp_fusion=_pkg.FP_FUSION,
            )
    del keep  # the copies may go: the launches are queued on the stream in order


# --- optimizer steps -------------------------------------------------------------------------


def step(op: StepOp, t: StepTensors, s, h, plan=None) -> None:
    """The reference's step op ``op`` in one launch per dtype group of the generic step kernel,
    with the op's update rule (``updates.UPDATES``): check, look the plan up, launch.

    ``t``, ``s``, ``h`` are the op's records (:mod:`fused_accum.ops`); the state lists the
    kernel reads are the non-empty ones of ``s`` (0 to 3 of them, fp32 like accs, in table
    columns STATE0..STATE2, in the record's order). Without ``plan``, per call each tensor's
    address is read, with the sizes of accs and grads, the dtypes of params, lp_params and
    grads and their contiguity; a miss of the table cache checks everything else.

    ``plan``: optional, any hashable the caller never reuses for other parameters. It promises
    that in every call with this plan the lists hold the same parameters in the same order, and
    that ``accs``, the state lists, ``remainders`` and, when ``lp_params`` are given, ``params``
    (the masters) are the same tensors, each at a fixed address relative to the first of its
    list (views of one flat buffer that moves, if ever, as a whole; the first addresses are
    checked each call). What a model or a backward owns is read each call, address and dtype:
    ``lp_params``, or ``params`` when there are none (with remainders: the bf16 parameters),
    and ``grads``; their sizes and strides are promised.

    With ``t.remainders`` (exact 2-byte masters) the remainders take the table's LP column and
    the kernels run HAS_REM: they rebuild each master from the bf16 param and its remainder and
    split the update back into both (kernels._rebuild_master / _split_master).
    """
    name, rule = op.name, updates.UPDATES[op.name]
    if t.sources:
        raise ValueError(f"{name}: sources are for host (CPU) steps; the triton backend does not read them")
    params, accs, lp_params, grads, remainders = t.params, t.accs, t.lp_params, t.grads, t.remainders
    lr, coef, found_inf = t.lr, t.coef, t.found_inf
    steps = t.steps if rule.reads_steps else None
    states = OrderedDict((field, lists) for field, lists in s._asdict().items() if lists)
    hyper, switches = rule.arguments(h, s)
    shape = ()
    if rule.reads_input:  # its first list, in the gradient's place (kernels.Update.reads_input)
        grads = list(states.pop(next(iter(states))))
        if rule.shaped:
            shape = checks.matrix_rows(name, s._fields[0], grads)
    checks.step_lengths(name, params, states, accs, lp_params, grads, remainders)
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
        where = plans.step_where(name, plan, device, params, states, accs, lp_params, grads, remainders)
        template = _pkg._template(
            where, lambda: plans.step_template(name, params, states, accs, lp_params, grads, device, remainders)
        )
    if template is None:  # no plan (or an unusable one): this call is a plan of its own
        params = checks.writable(params, write_back)
        lp_params = checks.writable(lp_params, write_back)
        remainders = checks.writable(remainders, write_back)
        grads = checks.readable(grads, keep)
        where = plans.unplanned_step_where(name, device, params, states, accs, lp_params, grads, remainders)
    read = plans.step_read(params, lp_params, grads)
    ptrs = [tuple(map(plans.data_ptr, xs)) for xs in read.values()]
    dtypes = [tuple(map(plans.dtype, xs)) for xs in read.values()]
    key = plans.Key(where, _stream(device), _pkg._config(), *ptrs, *dtypes, shape)
    launch = _pkg._lookup(key, capturing)
    if launch is None:
        if template is None:  # a call without a plan is checked on a miss only
            template = plans.step_template(name, params, states, accs, lp_params, grads, device, remainders)
        for what, xs, ds in zip(read, read.values(), dtypes):
            checks.check_dtypes(what, xs, ds)
        if remainders:  # the params read each call: still bf16 (a plan's dtypes may change)
            checks.check_remainders(name, params, remainders, lp_params, device)
        columns, keys = plans.step_columns(template, read, ptrs, dtypes, bool(remainders), shape)
        launch = _pkg._make_plan(device, template.numels, columns, keys, capturing)
        _pkg._store(key, launch, capturing)

    with _on(device):
        for (param_dtype, lp_dtype, grad_dtype), group_tables, _ in launch.launches:
            kernels.step_kernel[(group_tables.n_chunks,)](
                group_tables.chunks,
                group_tables.tensors,
                coef if steps is None else steps.contiguous(),  # (not read without rule.reads_steps)
                lr,
                coef,
                found_inf if found_inf is not None else coef,  # not read unless HAS_FOUND_INF
                group_tables.chunk,
                float(t.grad_alpha),
                hyper,
                PARAM_DTYPE=_TL_DTYPE[param_dtype],
                LP_DTYPE=_TL_DTYPE[lp_dtype],
                GRAD_DTYPE=_TL_DTYPE[grad_dtype],
                HAS_LP=bool(lp_params),
                HAS_REM=bool(remainders),
                FUSED=bool(grads),
                GRADS_OVERWRITE=bool(t.grads_overwrite),
                HAS_FOUND_INF=found_inf is not None,
                MAXIMIZE=bool(getattr(h, "maximize", False)),
                PREPARE=rule.prepare,
                UPDATE=rule.update,
                SWITCHES=switches,
                BLOCK=_pkg.BLOCK,
                WRITES_PARAM=rule.writes_param,
                READS_INPUT=rule.reads_input,
                num_warps=_pkg.step_num_warps(name, param_dtype.itemsize * 8, bool(lp_params), bool(remainders)),
                enable_fp_fusion=_pkg.FP_FUSION,
            )
    for original, copy in write_back:
        original.copy_(copy)
    del keep

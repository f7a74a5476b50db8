"""The operations of fused_accum, each declared once as a ``torch.library`` custom op.

Declaring them as custom ops (with fake implementations, which for these mutate-only ops do
nothing) lets ``torch.compile`` trace a training step that calls them without a graph break.
Callers use the plain names (``accumulate``, ``sgd_step``, ...): they go through the custom op
while torch.compile traces, and straight to the backend in eager mode, where the custom-op
wrapper costs ~30 us per call plus ~0.2 us per tensor (accumulate on the cpu backend, one
thread, warm caches, ``ops.accumulate_`` timed against ``ops.accumulate`` on the same
arguments: 36 us against 3.4 us for one tensor, 0.80 ms against 0.37 ms for 2,048 tensors of
256), more than a GPU spends on a bucket's kernel.

Optional tensor lists (``lp_params``, the fused step's ``grads``) are passed as empty lists when
absent: custom-op schemas have no optional list type. Each op takes the name of an
already-resolved backend (see :mod:`fused_accum.backends`) and forwards to that backend's
function; the contracts live in :mod:`fused_accum.backends.reference`.

``plan=`` (eager calls of accumulate and the three steps only): an optional hashable the caller
never reuses for other parameters, promising that the calls with it pass the same parameters'
tensors (what exactly it promises: ``fused_accum.backends.triton.accumulate`` and ``_step``).
It lets the triton backend skip re-reading what cannot have changed (issue 10 item 5: 2,048
tensors read for 1.5 ms per accumulate, 4 ms per AdamW step without it); backends that need no
such hint never see it, and torch.compile traces the op without it (a host-side cache key,
nothing to trace).
"""

from __future__ import annotations

import inspect
from typing import List, Optional

import torch
from torch import Tensor

from . import backends


def _hint(backend: str, plan) -> dict:
    # only a backend whose functions take ``plan=`` is passed it (the registry says which)
    return {"plan": plan} if plan is not None and backends.takes_plan(backend) else {}


def _custom_op(name: str, body, mutates_args: tuple):
    """The custom op of ``body`` without its last parameter (``hint``, a host-side cache key:
    nothing for torch.compile to trace, and no schema type for it); the op calls ``body`` with
    the default hint, None."""
    signature = inspect.signature(body)

    def op_body(*args):
        return body(*args)

    op_body.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:-1])
    op_body.__name__ = op_body.__qualname__ = body.__name__
    return torch.library.custom_op(name, mutates_args=mutates_args)(op_body)


def _accumulate(
    acc: Tensor,
    offsets: Tensor,
    grads: List[Tensor],
    alpha: float,
    overwrite: bool,
    found_inf: Optional[Tensor],
    sumsq: Optional[Tensor],
    backend: str,
    hint: Optional[dict] = None,
) -> None:
    backends.get(backend).accumulate(acc, offsets, grads, alpha, overwrite, found_inf, sumsq, **(hint or {}))


accumulate_ = _custom_op("fused_accum::accumulate_", _accumulate, mutates_args=("acc", "found_inf", "sumsq"))


@accumulate_.register_fake
def _(acc, offsets, grads, alpha, overwrite, found_inf, sumsq, backend):
    return None


def _sgd_step(
    params: List[Tensor],
    momentum_bufs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    lp_params: List[Tensor],
    grads: List[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    backend: str,
    hint: Optional[dict] = None,
) -> None:
    backends.get(backend).sgd_step(
        params,
        momentum_bufs,
        accs,
        steps,
        lr,
        coef,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        lp_params=lp_params,
        grads=grads,
        grad_alpha=grad_alpha,
        grads_overwrite=grads_overwrite,
        found_inf=found_inf,
        **(hint or {}),
    )


sgd_step_ = _custom_op("fused_accum::sgd_step_", _sgd_step, mutates_args=("params", "momentum_bufs", "lp_params"))


@sgd_step_.register_fake
def _(*args):
    return None


def _adam_step(
    params: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    lp_params: List[Tensor],
    grads: List[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    backend: str,
    hint: Optional[dict] = None,
) -> None:
    # amsgrad's running max is passed only when present (empty list: amsgrad off)
    amsgrad = dict(max_exp_avg_sqs=max_exp_avg_sqs) if max_exp_avg_sqs else {}
    backends.get(backend).adam_step(
        params,
        exp_avgs,
        exp_avg_sqs,
        accs,
        steps,
        lr,
        coef,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        maximize=maximize,
        lp_params=lp_params,
        grads=grads,
        grad_alpha=grad_alpha,
        grads_overwrite=grads_overwrite,
        found_inf=found_inf,
        **amsgrad,
        **(hint or {}),
    )


adam_step_ = _custom_op(
    "fused_accum::adam_step_",
    _adam_step,
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "lp_params"),
)


@adam_step_.register_fake
def _(*args):
    return None


def _lion_step(
    params: List[Tensor],
    exp_avgs: List[Tensor],
    accs: List[Tensor],
    steps: Tensor,
    lr: Tensor,
    coef: Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    maximize: bool,
    lp_params: List[Tensor],
    grads: List[Tensor],
    grad_alpha: float,
    grads_overwrite: bool,
    found_inf: Optional[Tensor],
    backend: str,
    hint: Optional[dict] = None,
) -> None:
    backends.get(backend).lion_step(
        params,
        exp_avgs,
        accs,
        steps,
        lr,
        coef,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        maximize=maximize,
        lp_params=lp_params,
        grads=grads,
        grad_alpha=grad_alpha,
        grads_overwrite=grads_overwrite,
        found_inf=found_inf,
        **(hint or {}),
    )


lion_step_ = _custom_op("fused_accum::lion_step_", _lion_step, mutates_args=("params", "exp_avgs", "lp_params"))


@lion_step_.register_fake
def _(*args):
    return None


def _wgrad_accumulate(acc: Tensor, grad_output: Tensor, input: Tensor, overwrite: bool, backend: str) -> None:
    # acc[N, K] = (0 if overwrite else acc) + grad_output[..., N]^T @ input[..., K], fp32
    # accumulation: the weight gradient of a Linear written into its fp32 accumulator slice
    # (contract in fused_accum.backends.wgrad; each backend's function: the registry's).
    backends.wgrad_kernel(backend, acc.device)(acc, grad_output, input, overwrite)


wgrad_accumulate_ = torch.library.custom_op("fused_accum::wgrad_accumulate_", mutates_args=("acc",))(_wgrad_accumulate)


@wgrad_accumulate_.register_fake
def _(acc, grad_output, input, overwrite, backend):
    return None


def _eager_or_traced(op, implementation, takes_plan: bool = True):
    if takes_plan:

        def call(*args, plan=None):
            if torch.compiler.is_compiling():
                return op(*args)  # the plan is a host-side cache key of the eager path
            return implementation(*args, _hint(args[-1], plan))
    else:

        def call(*args):
            return (op if torch.compiler.is_compiling() else implementation)(*args)

    call.__name__ = call.__qualname__ = implementation.__name__.lstrip("_")
    call.__doc__ = f"Run {op}: the custom op under torch.compile, the backend directly otherwise."
    return call


accumulate = _eager_or_traced(accumulate_, _accumulate)
sgd_step = _eager_or_traced(sgd_step_, _sgd_step)
adam_step = _eager_or_traced(adam_step_, _adam_step)
lion_step = _eager_or_traced(lion_step_, _lion_step)
wgrad_accumulate = _eager_or_traced(wgrad_accumulate_, _wgrad_accumulate, takes_plan=False)

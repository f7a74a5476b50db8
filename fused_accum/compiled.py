"""The window inside a compiled graph: what Dynamo traces of ``backward``, ``step`` and
``zero_grad``, and the op that keeps the window's books while the graph runs.

Eagerly a window is Python around the ops: hooks and callbacks fold each backward's gradients
and keep the ledger (fused_accum.window, fused_accum.ledger), and ``step()`` takes back what the
user did to ``.grad`` and ``opt.state`` before the fused step. A compiled graph replays tensor
ops only, so each of the three calls is split in two:

- **the tensor core**, traced: a backward's gradients (``torch.autograd.grad``, which Dynamo
  traces under ``torch._dynamo.config.trace_autograd_ops``) folded by the ``accumulate_`` custom
  op; the step's coefficient from the accumulator's norm on the device (clip, non-finite skip,
  ``num_items``: :func:`fused_accum.window.window_scale`), the step counts and the step op
  (:meth:`fused_accum.step.Stepper.step_call`). What the core does (which slots a fold
  overwrites, which a step steps) is decided at trace time from the ledger's record of which
  slots hold the window's gradient: Python state that Dynamo guards, so a window in another
  state retraces, never replays stale;
- **the books**, one call of the ``fused_accum::window_event`` op per traced call, run as
  Python while the graph runs (a custom op's body): what the user did to ``.grad`` taken back
  and the ledger's record of the backward or step (the window's and the optimizer's
  ``graph_*`` methods, beside their eager twins), the checks that refuse what the graph cannot
  follow, and the learning rates written into the flat groups' ``lr`` tensors, which the step
  op reads: a schedule changes them without a recompile. The op writes no buffer the graph
  reads (a functionalized graph would not see it) but the ``lr`` tensors it is handed, and
  declares those.

What stays eager (each call then breaks the graph, and ``fullgraph=True`` refuses it naming the
reason): the step of a ``torch.optim`` class, ``offload``, ``step_in_backward``, every data-parallel
topology, a closure, GradScaler, ``zero_grad(set_to_none=False)``, a parameter with a hook of its
own, a state buffer first needed now, and a backward without ``trace_autograd_ops``.

``opt.backward(loss)`` is the traced backward; eagerly it is ``loss.backward()``. Dynamo's own
trace of ``loss.backward()`` writes autograd's sums into ``.grad`` without the window's hooks,
so a compiled window calls ``opt.backward``.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import ops
from .algorithms import state_keys
from .window import window_scale

# --- the books' op -----------------------------------------------------------------------------

BACKWARD, STEP, ZERO_GRAD = 0, 1, 2  # what a window_event records
# Per slot, whether the ledger said it held the window's gradient as the graph was traced (a
# backward's code adds RECEIVED for a slot that gets a gradient): the books check the window
# agrees before recording.
EMPTY, HELD = 0, 1
RECEIVED = 4

_OPTIMIZERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_ids = itertools.count()


def register(optimizer) -> tuple:
    """A new optimizer's (id, token): the id its graphs name it by (a constant of the graph: the
    optimizer is held weakly), and the 0-d tensor its books' calls write in turn (their order)."""
    key = next(_ids)
    _OPTIMIZERS[key] = optimizer
    return key, torch.zeros((), dtype=torch.int64)


def _window_event(optimizer: int, event: int, code: list, token: Tensor, lrs: list) -> None:
    opt = _OPTIMIZERS.get(optimizer)
    if opt is None:
        raise RuntimeError(
            "fused_accum: this compiled function was traced with an optimizer that no longer exists; "
            "compile it again for the new optimizer"
        )
    token.add_(1)
    if event == BACKWARD:
        opt._window.graph_backward(code)
    elif event == STEP:
        opt._graph_step_books(code, lrs)
    else:
        opt._graph_zero_grad_books()


# Tagged cudagraph-unsafe: its body is Python, which a CUDA graph's replay would skip; under
# mode="reduce-overhead" inductor keeps it out of the captured partitions (and, as it depends
# on no tensor the graph computes, moves it ahead of them: one CUDA graph per window).
window_event = torch.library.custom_op(
    "fused_accum::window_event",
    _window_event,
    mutates_args=("token", "lrs"),
    schema="(int optimizer, int event, int[] code, Tensor(a!) token, Tensor(b!)[] lrs) -> ()",
    tags=(torch.Tag.cudagraph_unsafe,),
)
window_event.register_fake(lambda *args: None)

# --- what runs eagerly --------------------------------------------------------------------------

# Why a call runs eagerly inside a compiled region (eager_reason's answers). Each has its own
# torch.compiler.disable'd trampoline, so a graph break (an error under fullgraph=True) names it.
DETACHED = "the optimizer is detached (a newer one owns the parameters, or remove_hooks() was called)"
OFFLOAD = "offload='cpu' steps on the host"
STEP_IN_BACKWARD = "step_in_backward=True steps inside the backward's hooks"
DATA_PARALLEL = "a data-parallel or sharded topology reduces in hooks and collectives"
GENERIC = "a torch.optim class steps the parameters"
UNFROZEN = "a parameter frozen when added is trainable now (the eager step gives it buffers)"
OWN_HOOK = "a parameter has a hook of its own, which a compiled backward would not run"
NO_AUTOGRAD_OPS = "torch._dynamo.config.trace_autograd_ops is off: Dynamo cannot trace a backward"
CLOSURE = "a closure runs the model: compile the whole window instead"
GRAD_SCALER = "GradScaler steps through torch.amp's Python"
NEW_STATE = "a state buffer is first needed now (momentum or amsgrad turned on): the eager step allocates it"
ZERO_IN_PLACE = "zero_grad(set_to_none=False) zeroes the exposed gradients in place"


def _call(fn, *args):
    return fn(*args)


_EAGER = {
    reason: torch.compiler.disable(_call, reason=f"fused_accum runs this call eagerly: {reason} (fused_accum.compiled)")
    for reason in (
        DETACHED, OFFLOAD, STEP_IN_BACKWARD, DATA_PARALLEL, GENERIC, UNFROZEN, OWN_HOOK,
        NO_AUTOGRAD_OPS, CLOSURE, GRAD_SCALER, NEW_STATE, ZERO_IN_PLACE,
    )
}  # fmt: skip


def eagerly(reason: str, fn, *args):
    """``fn(*args)`` outside the compiled graph, which breaks there (``fullgraph=True``: Dynamo's
    error names ``reason``)."""
    return _EAGER[reason](fn, *args)


def eager_reason(opt, *, step: bool = False) -> Optional[str]:
    """Why ``opt``'s backward or zero_grad (``step``: its step) must run eagerly inside a
    compiled region (None: it traces)."""
    window = opt._window
    if window.detached_because is not None:
        return DETACHED
    if window.placement.hands_on_buckets:
        return OFFLOAD
    if opt.step_in_backward:
        return STEP_IN_BACKWARD
    # (one process's, decided or not: the books resolve it at the first backward, and refuse a
    # DDP wrapper found then; reading `decided` here would retrace once it is)
    if window.topology.name != "local" or window.topology.exact_norm:
        return DATA_PARALLEL
    if step:
        if opt._generic is not None:
            return GENERIC
        if opt._members.unfrozen():
            return UNFROZEN
    elif any(p._post_accumulate_grad_hooks or p._backward_hooks for p in window.params()):
        return OWN_HOOK  # (not asked of a step: it must not touch the parameters, see below)
    return None


# --- what each call traces ------------------------------------------------------------------
# Each decides from the ledger's record of which slots hold the window's gradient (has_grad:
# Python state, which Dynamo guards), never from .grad: a bf16 parameter whose .grad is the
# window's fp32 view cannot even be an input of a graph (Dynamo refuses a gradient of another
# dtype), so the step writes such parameters through their slots' ``weight`` aliases. A traced
# backward or zero_grad writes has_grad as Dynamo side effects too (what the books record), so a
# step later in the same graph sees them. What the user did to .grad since it was shown
# (assigned or cleared: the books' look finds it) is refused where it changes that record.


def _compressed(code: list) -> list:
    """One code standing for every slot where they agree (the books' op then takes one int, not
    one per parameter)."""
    return code[:1] if code and code.count(code[0]) == len(code) else code


def _held(slot) -> int:
    return HELD if slot._has_grad else EMPTY


def backward(opt, loss: Tensor) -> None:
    """``opt.backward(loss)`` as Dynamo traces it: this optimizer's gradients of ``loss``, each
    folded into its slice (overwriting where the window holds none yet)."""
    window = opt._window
    slots = [slot for slot in window.slots if slot.param.requires_grad]
    grads = torch.autograd.grad(loss, [slot.param for slot in slots], allow_unused=True)
    received = {slot.key: grad for slot, grad in zip(slots, grads) if grad is not None}
    code = [_held(slot) | (RECEIVED if slot.key in received else 0) for slot in window.slots]
    window_event(opt._graph_id, BACKWARD, _compressed(code), opt._graph_token, [])
    for flat in window.flat_groups:
        for overwrite in (True, False):
            slots = [s for s in flat.slots if s.key in received and s._has_grad != overwrite]
            if slots:
                offsets = torch.tensor([s.offset for s in slots], dtype=torch.int64)
                grads = [received[s.key] for s in slots]
                ops.accumulate(flat.acc, offsets, grads, 1.0, overwrite, None, None, flat.backend)
    for slot in window.slots:
        if slot.key in received:
            slot._has_grad = True


def step(opt, num_items) -> Optional[Tensor]:
    """``opt.step()`` as Dynamo traces it (``eager_reason`` None, and no state buffer to
    allocate): the books, then the window's coefficient and one step op per flat group, over
    the slots holding the window's gradient. Returns the window's norm (or None)."""
    window, stepper = opt._window, opt._stepper
    code = _compressed([_held(slot) for slot in window.slots])
    window_event(opt._graph_id, STEP, code, opt._graph_token, [flat.lr for flat in window.flat_groups])
    active = [[slot for slot in flat.slots if slot._has_grad] for flat in window.flat_groups]
    scale, skip, norm = window_scale(
        window,
        num_items,
        grad_scale=None,
        found_inf=None,
        max_grad_norm=opt.max_grad_norm,
        skip_nonfinite=opt.skip_nonfinite,
        active=active,
    )
    for flat, slots in zip(window.flat_groups, active):
        if slots:
            stepper.step_call(flat, slots, scale[flat.device], skip[flat.device] if skip else None)()
    return norm


def needs_new_state(opt) -> bool:
    """Whether a state buffer is first needed now (momentum turned on, amsgrad enabled): the
    eager step allocates it (a graph cannot), and the next call traces with it."""
    stepper = opt._stepper
    return any(
        key not in flat.state
        for flat in opt._window.flat_groups
        for key in state_keys(stepper.algorithm, stepper.param_groups[flat.group_index])
    )


def zero_grad(opt) -> None:
    """``opt.zero_grad()`` (``set_to_none=True``) as Dynamo traces it: the books discard the
    window and set every ``.grad`` of the param groups to None as the graph runs."""
    window_event(opt._graph_id, ZERO_GRAD, [], opt._graph_token, [])
    for slot in opt._window.slots:
        slot._has_grad = False

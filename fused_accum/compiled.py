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
  and the ledger's record of the backward or step (``backward_books``, ``step_books``,
  ``zero_grad_books``: the window's own steps, as its hooks and the eager step take them), the
  checks that refuse what the graph cannot follow, and the learning rates written into the flat
  groups' ``lr`` tensors, which the step op reads: a schedule changes them without a recompile.
  The op writes no buffer the graph reads (a functionalized graph would not see it) but the
  ``lr`` tensors it is handed, and declares those. The books depend on nothing the graph
  computes, so inductor may run them all ahead of its work (it does: under CUDA graphs, ahead
  of the captured partition); each records what its call has done by the graph's end, and
  nothing reads the record before then.

What stays eager (each call then breaks the graph, and ``fullgraph=True`` refuses it naming the
reason): the step of a ``torch.optim`` class, ``offload``, ``step_in_backward``, every data-parallel
topology, a closure, GradScaler, ``zero_grad(set_to_none=False)``, a parameter with a hook of its
own, a state buffer first needed now, and a backward without ``trace_autograd_ops``.

``opt.backward(loss)`` is the traced backward; eagerly it is ``loss.backward()``. Dynamo's own
trace of ``loss.backward()`` writes autograd's sums into ``.grad`` without the window's hooks,
so a compiled window calls ``opt.backward``; a step traced after such a ``.grad`` is refused
as it is traced (``_refuse_grads_around_the_window``).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor
from torch._dynamo.comptime import comptime

from . import ops
from .registry import state_keys
from .ledger import HAS_GRAD
from .window import check_num_items, window_scale

# --- the books' op -----------------------------------------------------------------------------

BACKWARD, STEP, ZERO_GRAD = 0, 1, 2  # what a window_event records
# Per slot, whether the ledger said it held the window's gradient as the graph was traced (a
# backward's code adds RECEIVED for a slot that gets a gradient): the books check the window
# agrees before recording.
EMPTY, HELD = 0, 1
RECEIVED = 4
ALIASED = 8  # (a step's code) the graph writes the parameters through their slots' weight aliases

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
    try:
        with _above_autograd():
            if event == BACKWARD:
                backward_books(opt, code)
            elif event == STEP:
                step_books(opt, code, lrs)
            else:
                zero_grad_books(opt)
    except Exception:
        # A refusal: the graph's work after this call does not run, and inductor may have run
        # every call of the books ahead of all of it (the record of a backward whose folds never
        # ran): the window is discarded, so that nothing claims gradients the buffers lack.
        opt._window.discard()
        raise


@contextlib.contextmanager
def _above_autograd():
    """Autograd's dispatch back for the books: a custom op's body runs below it (its key
    excluded), where the Python hooks' look, which asks autograd for each parameter's
    AccumulateGrad node (``get_gradient_edge``: a view's grad_fn), would find none."""
    key = torch._C.DispatchKey.AutogradFunctionality
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


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


def step_reason(opt, closure) -> Optional[str]:
    """Why ``opt.step(closure)`` must run eagerly inside a compiled region (None: it traces)."""
    if closure is not None:
        return CLOSURE
    if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
        return GRAD_SCALER
    if needs_new_state(opt):
        return NEW_STATE
    return eager_reason(opt, "step")


def eager_reason(opt, call: str) -> Optional[str]:
    """Why ``opt``'s ``call`` (``"backward"``, ``"step"`` or ``"zero_grad"``) must run eagerly
    inside a compiled region (None: it traces)."""
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
    if call == "step":
        if opt._generic is not None:
            return GENERIC
        if opt._members.unfrozen():
            return UNFROZEN
    elif call == "backward" and any(p._post_accumulate_grad_hooks or p._backward_hooks for p in window._params):
        return OWN_HOOK
    # (only a backward asks the parameters: after eager backwards, a bf16 parameter whose .grad
    # shows its fp32 view cannot be an input of the graph, which Dynamo makes of a parameter
    # whose attribute is read: a step or zero_grad then could not trace)
    return None


# --- what each call traces ------------------------------------------------------------------
# Each decides from the ledger's record of which slots hold the window's gradient (has_grad:
# Python state, which Dynamo guards), never from .grad: a bf16 parameter whose .grad is the
# window's fp32 view cannot even be an input of a graph (Dynamo refuses a gradient of another
# dtype), so a step after eager backwards writes such parameters through their slots' ``weight``
# aliases. A traced backward or zero_grad writes has_grad as Dynamo side effects too (what the
# books record), so a step later in the same graph sees them. What the user did to .grad since
# it was shown (assigned or cleared: the books' look finds it) is refused where it changes that
# record.


def _compressed(code: list) -> list:
    """One code standing for every slot where they agree (the books' op then takes one int, not
    one per parameter)."""
    return code[:1] if code and code.count(code[0]) == len(code) else code


def _held(slot) -> int:
    return HELD if slot._has_grad else EMPTY


def backward(opt, loss: Tensor) -> None:
    """``opt.backward(loss)`` inside a compiled region: traced (``_traced_backward``), or
    ``loss.backward()`` eagerly (a graph break) where it cannot be."""
    reason = eager_reason(opt, "backward")
    if reason is None and not torch._dynamo.config.trace_autograd_ops:
        reason = NO_AUTOGRAD_OPS
    if reason is None:
        return _traced_backward(opt, loss)
    return eagerly(reason, loss.backward)


def step(opt, closure, num_items):
    """``opt.step()`` inside a compiled region: traced (``_traced_step``), or the eager step
    (a graph break) where it cannot be."""
    reason = step_reason(opt, closure)
    if reason is not None:
        return eagerly(reason, opt._step, closure, num_items)
    if num_items is not None and not isinstance(num_items, Tensor):
        check_num_items(num_items)
    _refuse_grads_around_the_window(opt)
    norm = _traced_step(opt, num_items)
    if norm is not None:
        opt._last_norm.value = norm
    return None


def zero_grad(opt, set_to_none: bool) -> None:
    """``opt.zero_grad()`` inside a compiled region: traced (``_traced_zero_grad``), or eagerly
    (a graph break) where it cannot be."""
    reason = eager_reason(opt, "zero_grad") or (None if set_to_none else ZERO_IN_PLACE)
    if reason is not None:
        return eagerly(reason, opt.zero_grad, set_to_none)  # (run eagerly: it is not compiling there)
    return _traced_zero_grad(opt)


def _refuse_grads_around_the_window(opt) -> None:
    """As Dynamo traces a step where ``.grad`` does not show the window (a step after eager
    backwards reads no ``.grad``: ``ALIASED``): a ``.grad`` the window did not write is refused
    as the graph is traced, before any of it runs. The traced step steps the slots holding the
    window's gradient, from its buffers, and would ignore it: silently, in the first window of
    the plain loop compiled whole (``loss.backward()`` traced under ``trace_autograd_ops``
    assigns autograd's own sums and runs no hook, so the window holds nothing). A ``.grad``
    the user assigned is refused too (eagerly it is taken)."""
    window = opt._window
    if window.ledger.shown:
        return
    for slot in window.slots:
        if slot.param.grad is not None and not slot._has_grad:
            message = (  # noqa: F841 (read by _refuse_as_traced, through comptime's ctx.get_local)
                f"{window.label}: parameter {slot.name} has a .grad that the window did not fold, so this "
                "compiled step would step nothing from it. Under torch._dynamo.config.trace_autograd_ops, a "
                "loss.backward() inside the compiled function is traced: it writes autograd's own sums into "
                ".grad and runs none of the optimizer's hooks. Inside the compiled function call "
                "opt.backward(loss) instead (eagerly it is loss.backward(); the one-graph window, "
                "docs/compile.md), or call loss.backward() outside it. A .grad you assigned yourself: call "
                "opt.step() outside the compiled function, which takes it."
            )
            comptime(_refuse_as_traced)


def _refuse_as_traced(ctx) -> None:
    """Run by Dynamo as it traces (a comptime function): its ``UserError`` reaches the user as
    it is, message first. (Without ``fullgraph=True`` Dynamo gives the frame up and runs it
    eagerly; the step, compiled as a frame of its own, then refuses the assigned ``.grad`` in its
    books: ``_take_back``.)"""
    message = ctx.get_local("message").as_python_constant()
    raise torch._dynamo.exc.UserError(torch._dynamo.exc.UserErrorType.INVALID_INPUT, message)


def _traced_backward(opt, loss: Tensor) -> None:
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
    window.ledger.held_in_trace([slot for slot in window.slots if slot.key in received], True)


def _traced_step(opt, num_items) -> Optional[Tensor]:
    """``opt.step()`` as Dynamo traces it (``eager_reason`` None, and no state buffer to
    allocate): the books, then the window's coefficient and one step op per flat group, over
    the slots holding the window's gradient. Returns the window's norm (or None)."""
    window, stepper = opt._window, opt._stepper
    # A bf16 parameter whose .grad shows the window's fp32 view cannot be an input of the graph:
    # where the window was shown as the call began (a step after eager backwards), the step
    # writes the parameters through their aliases (in a window compiled whole, the parameters
    # are the forward's inputs already, and .grad was None as it began).
    aliased = window.ledger.shown
    code = _compressed([_held(slot) | (ALIASED if aliased else 0) for slot in window.slots])
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
            skipped = skip[flat.device] if skip else None
            stepper.step_call(flat, slots, scale[flat.device], skipped, aliased=aliased)()
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


def _traced_zero_grad(opt) -> None:
    """``opt.zero_grad()`` (``set_to_none=True``) as Dynamo traces it: the books discard the
    window and set every ``.grad`` of the param groups to None as the graph runs."""
    window_event(opt._graph_id, ZERO_GRAD, [], opt._graph_token, [])
    opt._window.ledger.held_in_trace(opt._window.slots, False)


# --- the books, as the graph runs ---------------------------------------------------------------
# The graph does the tensor work (the folds, the step); these take back what the user did to
# .grad and record the graph's work as the window's hooks and the eager step would, with the
# window's own steps (GradientWindow, Folder, Ledger: the eager backward's and step's, in that
# order). ``code``: per slot, whether the ledger said it held the window's gradient when the graph
# was traced (HELD or EMPTY, and RECEIVED; one code for all where they agree), which the window
# must agree with before anything is recorded.


def _code(code: list, key: int) -> int:
    return code[0] if len(code) == 1 else code[key]


def backward_books(opt, code: list) -> None:
    """A traced backward's books: its start (the window's checks) and its end (the micro-batch
    counted, ``.grad`` showing the window), as the hooks' callbacks record them."""
    window = opt._window
    window.check_attached()
    with window.lock, window.ledger.planning():
        _take_back(window, code, before_backward=True)
        if len(code) == 1:
            received = window.slots if code[0] & RECEIVED else []
        else:
            received = [slot for slot, c in zip(window.slots, code) if c & RECEIVED]
        if received:
            window.ledger.folded_in_graph(received)
            window.topology.added()
            window.topology.backward_ended(window.ledger, window.flat_groups)
            window._count_microbatch()
        window.expose()
        window._folder.arm_quiet()
        window.placement.backward_ended(window.flat_groups)


def step_books(opt, code: list, lrs: list) -> None:
    """A traced step's books: what the eager step checks and takes back (``opt.state`` too: an
    edit refused, a first step's entries shown), each group's learning rate written into
    ``lrs`` (its flat groups' ``lr``), and the window's end."""
    window, stepper = opt._window, opt._stepper
    window.check_attached()
    opt._members.check_unchanged(opt.param_groups, type(opt).__name__)
    opt._opt_called = True  # (for an LR scheduler: see fused_accum.optimizer, below the class)
    opt._members.check_none_unfrozen(type(opt).__name__)
    with window.lock:
        _take_back(window, code, before_backward=False)
        _check_agrees(window, code)
    stale = [slot.name for flat in window.flat_groups for slot in flat.stale_weights()] if code[0] & ALIASED else []
    if stale:
        for flat in window.flat_groups:
            flat.refresh_weights()  # (the next call's graph takes the new storage)
        raise RuntimeError(
            f"{window.label}: the .data of parameter {stale[0]} was replaced since the last step, and this "
            "compiled step writes its old storage: it is refused; the next compiled call writes the new one"
        )
    for flat, lr in zip(window.flat_groups, lrs):
        active = [slot for slot in flat.slots if slot.has_grad]
        if active:
            group = stepper.param_groups[flat.group_index]
            stepper.write_lr(lr, group)
            stepper.take_user_state(flat, active, group, values=False)
    window.after_step()


def zero_grad_books(opt) -> None:
    """A traced ``zero_grad()``'s books: the window discarded, every ``.grad`` of the param
    groups None."""
    window = opt._window
    _take_back(window, (), before_backward=None)
    window.placement.discarded(window.flat_groups)
    window.discard()
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def _take_back(window, code: list, before_backward: Optional[bool]) -> None:
    """The look a backward's checks or the step take first, and what the user did to ``.grad``
    taken back (``before_backward`` None: nothing to take, the window is discarded next). Refuses
    what the graph, traced over these buffers with the gradients the ledger recorded, cannot
    follow: a ``.grad`` assigned (its values), a parameter moved or cast, gradients an eager
    backward left unfolded, a DDP wrapper found now."""
    if not window.topology.decided and window.resolve_topology().name != "local":
        raise RuntimeError(
            f"{window.label}: a DistributedDataParallel wrapper owns these gradients, which a compiled "
            "window cannot fold (fused_accum.compiled): run the window eagerly"
        )
    table = window._arrivals  # (the hooks' table: its look, without the eager one's re-homing)
    if table.has_arrivals():
        raise RuntimeError(
            f"{window.label}: an eager backward left gradients unfolded before a compiled call "
            "(it raised?); call opt.zero_grad() or finish the window eagerly"
        )
    look = table.look(window._params)
    if look.moved:
        raise RuntimeError(
            f"{window.label}: parameters moved or were cast (model.to(...)) since the compiled graph "
            "was traced over their buffers: call opt.zero_grad() outside the compiled function once, "
            "which moves the buffers after them"
        )
    if before_backward is None:
        return
    for key in look.changed:  # (cleared ones are taken below: the check then refuses them)
        slot = window.slots[key]
        grad = slot.param.grad
        if grad is not None and (grad is not slot.grad_view or grad.data_ptr() != slot.acc.data_ptr()):
            raise RuntimeError(
                f"{window.label}: parameter {slot.name}'s .grad was assigned (or its .data re-pointed) since "
                "the window showed it, and a compiled call cannot read the values assigned (its graph "
                "folds and steps the window's buffers): edit .grad in place, or make this call outside "
                "the compiled function. (A loss.backward() that Dynamo traced under trace_autograd_ops "
                "assigns autograd's own sums, bypassing the window: call opt.backward(loss) there.)"
            )
    window._folder.take_report()
    if window.ledger.shown:
        window.reconcile(look.changed, before_backward=before_backward)
    if before_backward:
        window.ledger.checked()
        _check_agrees(window, code)


def _check_agrees(window, code: list) -> None:
    """The slots holding a gradient are those the graph was traced with: a ``.grad`` cleared
    since (which discards its gradient) is refused, never stepped or added to."""
    held = list(map(HAS_GRAD, window.slots))  # (C-level: this runs at every call of a graph)
    if len(code) == 1:
        agrees = all(held) if code[0] & HELD else not any(held)
    else:
        agrees = held == [bool(c & HELD) for c in code]
    if agrees:
        return
    for slot in window.slots:
        if slot.has_grad != bool(_code(code, slot.key) & HELD):
            raise RuntimeError(
                f"{window.label}: parameter {slot.name} {'holds' if slot.has_grad else 'holds no'} a "
                "gradient in this window, unlike when the compiled graph was traced (its .grad was "
                "cleared since it was shown?); a compiled call follows the window's own record: clear "
                "gradients with opt.zero_grad(), or make this call outside the compiled function"
            )

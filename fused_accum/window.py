"""The gradient window: everything between two optimizer steps.

While it is open, each parameter's gradients are folded into its slice of the flat fp32
accumulator (:mod:`fused_accum.flat`):

1. Hooks on each parameter's AccumulateGrad node (:mod:`fused_accum.arrivals`, in C++ where the
   extension is built) take each new gradient (in its own dtype: ``p.grad_dtype = None`` for
   bf16/fp16 params stops autograd casting it) into the parameter's bucket.
2. A complete bucket is folded (:mod:`fused_accum.fold`): one ``accumulate_`` call, the window's
   first gradient of a slice overwriting it, so no zeroing pass is needed.
3. A callback queued on the autograd engine sees the backward end: it folds partial buckets,
   counts the micro-batch and shows every gradient's fp32 running sum in ``.grad``
   (:mod:`fused_accum.exposure`), exactly where native accumulation would show a ``.grad``.
   Once shown, ``.grad`` is the truth, as with torch's optimizers.

This module holds that sequence: the hooks' callbacks, the count of backwards, the start and the
end of each backward and of the window, and which parameters it owns (:mod:`fused_accum.owners`).
What else happens where data parallelism is involved (DDP standing aside, reductions, sharded
buffers, FSDP2) is its topology's (:mod:`fused_accum.topology`), asked at fixed points.

Where the step runs is its placement's (:mod:`fused_accum.placement`: the device, or the host
with offload), also asked at fixed points.

``accum_steps`` (when known) is only a hint that enables fusions on the window's last backward:
``step_in_backward`` steps buckets as they complete, data-parallel buckets are reduced while the
backward still runs, and a placement may take each bucket as it completes (offload).

The hooks hold the window weakly and nothing below holds it, so deleting the optimizer frees
everything at once; a finaliser then removes the hooks.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import owners
from . import compiled_backward
from .arrivals import _untraced, make_arrivals
from .flat import LOW_PRECISION, FlatGroup, Slot
from .fold import Folder, WgradTarget
from .ledger import Exposure, Ledger
from .placement import Placement
from .topology import Local
from .topology.base import sum_of_squares

_current_graph_task_id = torch._C._current_graph_task_id


def wgrad_target(param: Tensor) -> Optional[WgradTarget]:
    """Where a weight-gradient GEMM may write ``param``'s gradient in place, or None when the
    gradient must be returned to autograd as usual (no live optimizer owns ``param``, or the
    window cannot take an in-place gradient now)."""
    window = owners.owner(param)
    return None if window is None else window.wgrad_target(param)


# The hooks' calls into the window (see fused_accum.arrivals). They hold it weakly: no reference
# cycle through the parameters' autograd nodes, nothing of the optimizer kept alive.
def _before_backward(window_ref) -> None:
    window = window_ref()
    if window is not None:
        window._before_backward()


def _queue_end(window_ref) -> None:
    window = window_ref()
    if window is not None:
        with window.lock:  # (it may hand a plan: another thread's backward may be in a callback)
            window._queue_end_of_backward(arrived=True)


def _bucket_complete(window_ref, bucket_id: int, grads: list) -> None:
    window = window_ref()
    if window is not None:
        with window.lock:  # (every slot of a bucket arrived in this backward: fold them)
            window._folder.bucket_complete(bucket_id, grads)


def _fold_hooked(window_ref, key: int, grad: Tensor) -> bool:
    window = window_ref()
    return window is not None and window._fold_hooked(key, grad)


def _backward_raised(window_ref) -> None:
    window = window_ref()
    if window is not None:
        window._backward_raised(None)


def _compiled_backward(window_ref) -> list:
    window = window_ref()
    return [] if window is None else compiled_backward.capture(window)


def _compiled_first(window_ref, key: int):
    window = window_ref()
    if window is None:
        return None
    with window.lock:
        return window.captured.first(window.slots[key], window.topology)


class _EndOfBackward:
    """The window's end-of-backward callback for one graph task. The engine drops a backward's
    final callbacks unrun when it raises, and this one is then let go unrun: that is how the
    window learns that the backward ended in an error."""

    __slots__ = ("window_ref", "task", "ran")

    def __init__(self, window_ref, task: int) -> None:
        self.window_ref, self.task, self.ran = window_ref, task, False

    @_untraced  # (queued on the engine: see arrivals._untraced)
    def __call__(self) -> None:
        self.ran = True
        window = self.window_ref()
        if window is not None:
            window._end_of_backward(self.task)

    @_untraced  # (dropped by the engine, maybe inside a compiled function's backward)
    def __del__(self) -> None:
        window = None if self.ran else self.window_ref()
        if window is not None:
            window._backward_raised(self.task)


def _detach_all(arrivals, handles: list) -> None:
    arrivals.detach_all()
    for handle in handles:
        handle.remove()
    handles.clear()


class GradientWindow:
    """Hooks, micro-batch counting, ``.grad`` exposure, and the end of the window."""

    def __init__(
        self, *, accum_steps, step_in_backward, wants_stats, topology: Local, stepper, label, placement: Placement
    ):
        self.accum_steps = accum_steps
        self.step_in_backward = step_in_backward
        self._stepper = stepper  # step.Stepper: rehome(flat), fused_step (no reference up)
        self.label = label  # how errors name the optimizer
        self.flat_groups: list[FlatGroup] = []
        self._params: list = []  # by key: the parameters (what the table's look is asked about)
        self._slot_of: dict = {}  # id(param) -> slot
        self.detached_because: Optional[str] = None
        self._tasks: dict = {}  # graph task id -> did a gradient arrive in it (end callback queued)
        self.lock = threading.RLock()  # (autograd runs one thread per device)
        this = weakref.ref(self)
        self._arrivals = make_arrivals(
            functools.partial(_before_backward, this),
            functools.partial(_queue_end, this),
            functools.partial(_bucket_complete, this),
            functools.partial(_fold_hooked, this),
            functools.partial(_backward_raised, this),
        )
        self._arrivals.compile_with(
            _untraced(functools.partial(_compiled_backward, this)), _untraced(functools.partial(_compiled_first, this))
        )
        self._handles: list = []  # of Python hooks a topology added (FSDP2's on DTensor parameters)
        self.placement = placement  # where the step runs (fused_accum.placement)
        # the window's state (counts, what is shown, every slot's window fields)
        self.ledger = Ledger(
            self._arrivals, label, accum_steps, step_in_backward, wants_stats, placement.hands_on_buckets
        )
        self.slots: list[Slot] = self.ledger.slots  # by key
        self._folder = Folder(
            ledger=self.ledger,
            flat_groups=self.flat_groups,
            stepper=stepper,
            topology=topology,
            label=label,
            step_in_backward=step_in_backward,
            lock=self.lock,
            placement=placement,
        )
        self._exposure = Exposure(self.ledger, self.flat_groups, self._folder)
        self.captured = compiled_backward.CapturedFolds(self.ledger, self.flat_groups)
        self._finalizer = weakref.finalize(self, _detach_all, self._arrivals, self._handles)

    @property
    def topology(self) -> Local:
        """Who else owns the gradients (fused_accum.topology); the folds ask it too."""
        return self._folder.topology

    @topology.setter
    def topology(self, topology: Local) -> None:
        self._folder.topology = topology
        self.ledger.set_stands_aside(topology.stands_aside)

    # --- membership ------------------------------------------------------------------------

    def add(self, flat: FlatGroup) -> None:
        self.topology.add(self.ledger, flat)
        self.ledger.join(flat.slots)  # (new slots: show again)
        self._folder.add(flat)
        self.flat_groups.append(flat)
        self._params.extend(s.param for s in flat.slots)
        self._slot_of.update((id(s.param), s) for s in flat.slots)

    def param_groups(self) -> list:  # (the optimizer's: what its step reads)
        return self._stepper.param_groups

    def slot_for(self, param: Tensor) -> Optional[Slot]:
        slot = self._slot_of.get(id(param))
        return slot if slot is not None and slot.param is param else None

    def attach(self, slots: list) -> None:
        """Hook ``slots`` and own their parameters; a live window that owned any of them is
        detached first (the newest optimizer over a parameter wins: fused_accum.owners)."""
        owners.claim(self, [s.param for s in slots])
        for slot in slots:
            p = slot.param
            if p.dtype in LOW_PRECISION:
                # Let bf16/fp16 gradients reach the hook uncast, and let .grad be our fp32 view.
                p.grad_dtype = None
            self._arrivals.attach(slot.key, p)
            self.topology.attach(self, slot)

    def add_handle(self, handle) -> None:
        """A hook a topology registered: removed with the window's own."""
        self._handles.append(handle)

    def detach(self, reason: str) -> None:
        """Stop taking gradients (autograd fills ``.grad`` natively again) and give up the
        parameters; warns if the window held gradients that are now discarded."""
        if self.detached_because is not None:
            return
        if self.ledger.pending():
            warnings.warn(
                f"{self.label} was detached ({reason}) with gradients accumulated in its window: they are discarded",
                stacklevel=4,
            )
        _detach_all(self._arrivals, self._handles)
        owners.release(self, [s.param for s in self.slots])
        for slot in self.slots:
            if slot.param.grad is slot.grad_view:
                slot.param.grad = None
        self.detached_because = reason

    def check_attached(self) -> None:
        if self.detached_because is not None:
            raise RuntimeError(f"{self.label} can no longer step: {self.detached_because}. Use the newer optimizer.")

    # --- hooks ------------------------------------------------------------------------------

    def resolve_topology(self) -> Local:
        """Decided once, at the first backward (or step): a DDP wrapper built after the
        optimizer owns .grad, and the hooks stand aside."""
        if not self.topology.decided:
            self.topology = self.topology.resolve([s.param for s in self.slots])
        return self.topology

    def _look(self) -> tuple:
        """One C++ pass over the parameters (``HookTable.look``): those whose AccumulateGrad node
        autograd replaced (``model.to`` or Accelerate's ``prepare`` moved or cast ``.data``) are
        hooked again and their flat groups moved after them (else they would accumulate natively
        for good); returned, the keys whose ``.grad`` the user changed since it was shown."""
        look = self._arrivals.look(self._params)
        if not look.moved:
            return look.changed
        for key in look.moved:
            param = self.slots[key].param
            if param.dtype in LOW_PRECISION:
                param.grad_dtype = None  # (a cast gives the parameter torch's default again)
        for index in sorted({self.slots[key].flat_index for key in look.moved}):
            flat = self.flat_groups[index]
            param = flat.slots[0].param
            if param.device != flat.device or param.dtype != flat.dtype:
                self.rehome(flat)
        self._exposure.forget()  # new views and nodes: decide again
        self._folder.forget_grants()
        return look.changed

    def rehome(self, flat: FlatGroup) -> None:
        """Move ``flat``'s buffers after its parameters (moved or cast): no gradient survives."""
        self._stepper.rehome(flat)
        self.ledger.moved(flat.slots)

    def _before_backward(self) -> None:
        """The hooks' once-per-backward checks (while the plan's ``slow`` is set, before the
        first gradient is taken): DDP, a reduce-scattered window, and what the user did to an
        exposed ``.grad``; what they decide goes to the hooks as one plan."""
        with self.lock, self.ledger.planning():
            if self.resolve_topology().stands_aside:
                return
            self.take_edits()
            self.ledger.checked()
            # Seen from now, not only from the first arrival: should this backward raise before
            # one, .grad must still show the window again (see _backward_raised).
            self._queue_end_of_backward(arrived=False)
            self._folder.grant_fast_folds()

    def take_edits(self) -> None:
        """Before a backward touches any ``.grad`` (eager, or captured by compiled autograd):
        nodes autograd rebuilt, what the user did to ``.grad``, the report of a backward that
        raised before its end."""
        changed = self._look()
        self._folder.take_report()
        self.topology.before_backward(self.ledger)
        if self.ledger.shown:
            self.reconcile(changed, before_backward=True)
        else:
            self._exposure.take_assigned_grads(changed)

    def wgrad_target(self, param: Tensor, hooked: bool = False) -> Optional[WgradTarget]:
        """Where ``param``'s gradient may be written in place now (fold.Folder.in_place_target);
        ``hooked``: by _fold_hooked."""
        slot = self.slot_for(param)
        if slot is None or self.detached_because:
            return None
        if not self._folder.takes_in_place(slot, self.resolve_topology(), hooked):
            return None
        with self.lock:
            self._queue_end_of_backward(arrived=True)
            return self._folder.in_place_target(slot)

    def _fold_hooked(self, key: int, grad: Tensor) -> bool:
        """A parameter with a user's post-accumulate-grad hook or post-hook on its AccumulateGrad
        node: folded now, its running sum in ``.grad``, which the hook (AccumulateGrad, handed an
        undefined gradient, still runs both: torch 2.11-2.14) sees and may edit, as natively.
        False where it cannot be folded alone."""
        slot = self.slots[key]
        target = self.wgrad_target(slot.param, hooked=True)
        if target is None:
            return False
        self._folder.fold_one(target, grad)
        if slot.param.grad is not slot.grad_view:
            slot.param.grad = slot.grad_view  # (as the table would show it at the end)
        return True

    def _backward_raised(self, task: Optional[int]) -> None:
        """A backward raised before its end (``task``: its graph task, None for one the hooks
        ran quietly). What arrived before the error is in ``.grad`` natively (AccumulateGrad
        ran for those parameters): fold the buckets it left partly filled and show the window
        again, so a clip or a ``zero_grad()`` that follows sees it, as with torch. It does not
        count as a micro-batch (a retried backward is the one that counts)."""
        with self.lock, self.ledger.planning():  # (one report taken, in flush; one plan handed)
            if task is not None:
                self._tasks.pop(task, None)
            if self.detached_because is not None:
                return
            self._folder.revoke_fast()
            self.flush()
            self.topology.backward_raised(self.ledger, self.flat_groups)  # (a reduction it began)
            self.placement.discarded(self.flat_groups)  # (what it took lacks the retried backward)
            self.expose()

    def count_captured(self) -> None:
        """A backward compiled autograd captures is counted as it is captured (compiled_backward:
        no end of backward is seen), and ``.grad`` shows the window with the plan handed."""
        self._folder.revoke_fast()
        self.ledger.backward_ended()
        self.expose()

    def _queue_end_of_backward(self, arrived: bool) -> None:
        """Queue ``_end_of_backward`` once per backward (graph task). Keyed by the task rather
        than a flag: a backward that raised before its end leaves nothing stuck (ids are never
        reused), and reentrant backwards nested in it keep their own."""
        task = _current_graph_task_id()
        seen = self._tasks.get(task)
        if seen is None:
            torch.autograd.Variable._execution_engine.queue_callback(_EndOfBackward(weakref.ref(self), task))
            self._tasks[task] = arrived
            if self.ledger.fast is not None:
                self.ledger.seen(task)  # (this backward is not quiet: this callback ends it)
        elif arrived and not seen:
            self._tasks[task] = True

    # --- counting ---------------------------------------------------------------------------

    @property
    def microbatches(self) -> int:
        """Backward passes in this window (0 once the user cleared every ``.grad`` it showed:
        that is a new window, which the next backward's reconcile would start). Reads only."""
        return 0 if self._exposure.all_cleared() else self.ledger.microbatches

    def flush(self) -> None:
        """Fold what arrived for buckets this backward did not complete."""
        with self.lock:
            self._folder.flush()

    # --- end of a backward ----------------------------------------------------------------------

    def _end_of_backward(self, task: int) -> None:
        with self.lock, self.ledger.planning():  # (one report taken, in flush; one plan handed, at the end)
            arrived = self._tasks.pop(task, False)
            self._folder.revoke_fast()  # granted for this backward only
            self.flush()
            enclosing = torch._C._current_autograd_node()
            if enclosing is not None:
                # This backward ran inside a node of another one (checkpoint(use_reentrant=True)
                # re-enters the engine): the micro-batch ends with the outermost backward, so
                # queue there once that node is done.
                enclosing.register_hook(_untraced(lambda *_: self._queue_end_of_backward(arrived)))
                return
            if arrived:
                self.topology.backward_ended(self.ledger, self.flat_groups)
                self._count_microbatch()
            self.expose()
            self._folder.arm_quiet()
            self.placement.backward_ended(self.flat_groups)

    def _count_microbatch(self) -> None:
        ledger = self.ledger
        syncs = self.topology.syncs(ledger)
        ledger.backward_ended()
        if ledger.may_step_in_backward and ledger.microbatches == self.accum_steps and not ledger.pieces_seen:
            self._folder.step_the_rest()
        elif syncs:
            self.finish_reduction()

    def finish_reduction(self) -> None:
        """Complete the data-parallel reduction of what was added since the last one (if
        anything): afterwards every slot holds the group's gradient."""
        self.topology.finish(self.ledger, self.flat_groups)

    def expose(self) -> None:
        """``.grad`` shows the window's fp32 sums, set with the next plan handed (Exposure.show)."""
        self._exposure.show()

    # --- .grad is the truth (fused_accum.exposure) ----------------------------------------------

    def reconcile(self, changed: Optional[tuple] = None, before_backward: bool = False) -> None:
        """Take what the user did to an exposed ``.grad`` (``changed``: the keys a look found;
        None: look now), before anything reads the buffers (a backward's checks: before it
        touches any ``.grad``)."""
        with self.lock:
            if self._exposure.reconcile(self._look() if changed is None else changed, before_backward):
                self._forget_all()  # everything was cleared: a new window starts

    def take_user_grads(self, pairs: list) -> None:
        self._exposure.take_user_grads(pairs)

    # --- the window's end ---------------------------------------------------------------------

    def after_step(self) -> None:
        """The optimizer stepped: the next backward starts counting micro-batches anew. The
        accumulated gradients stay (``.grad`` keeps showing them, as torch's ``.grad`` does
        until ``zero_grad()``); a backward before ``zero_grad()`` adds to them, and is never
        stepped in backward (see Ledger.stepped). One plan handed, ``.grad``'s views with it."""
        with self.ledger.planning():
            self.ledger.stepped()
            self.topology.after_step(self.ledger, self.flat_groups)
            self.expose()

    def zero_grad(self, set_to_none: bool) -> None:
        """``opt.zero_grad()``: discard the window (``set_to_none``; a sharded topology has no
        full gradient to zero), else zero the exposed gradients in place, as torch does."""
        changed = () if self.topology.stands_aside else self._look()
        self.placement.discarded(self.flat_groups)  # (what it took of a window that will not step)
        if set_to_none or self.topology.sharded:
            self.discard()
        else:
            self.flush()
            self.reconcile(changed)
            self._exposure.zero_held()
            self.ledger.window_started()
            self.topology.after_step(self.ledger, self.flat_groups)
            self.expose()
        if _current_graph_task_id() >= 0:
            # Called from a hook while a backward runs: what arrives after is the new window's,
            # and that backward, now not quiet (Python changed the window), ends here and counts.
            self._queue_end_of_backward(arrived=True)

    def discard(self) -> None:
        """Forget every gradient of the window (also any left in buckets by a raised backward)."""
        self.ledger.clear_table()
        self._tasks.clear()  # those of a backward that raised: they will never run
        self._forget_all()
        self._exposure.clear_all()

    def _forget_all(self) -> None:
        """Every gradient is gone and no ``.grad`` shows a view: a new window starts."""
        self.placement.discarded(self.flat_groups)  # (what it took of a window that will not step)
        self.topology.reset()
        self.ledger.discarded()
        self.topology.after_step(self.ledger, self.flat_groups)


def check_num_items(num_items) -> None:
    """``num_items`` given as a Python number: positive and finite (a tensor's is the step's skip)."""
    if not (num_items > 0 and math.isfinite(num_items)):
        raise ValueError(f"num_items must be positive and finite, got {num_items!r}")


def window_scale(window, num_items, *, grad_scale, found_inf, max_grad_norm, skip_nonfinite, active=None) -> tuple:
    """The step's coefficient for ``window``: (coef per device, skip flag per device or None, the window's
    norm or None), computed on the device without a host sync: 1/num_items x 1/grad_scale x the clip factor; skip when
    num_items is not positive and finite, when GradScaler found an inf, or (skip_nonfinite) when
    the window's gradient has one. ``grad_scale``/``found_inf``: what GradScaler.step set on the
    optimizer. ``active``: the slots holding the window's gradient, per flat group (a compiled
    step's, one process; None: the topology's norm, from the ledger)."""
    devices = list(dict.fromkeys(flat.device for flat in window.flat_groups))
    if not devices:
        return {}, None, None
    home = devices[0]
    fp32 = dict(dtype=torch.float32, device=home)
    coef = torch.ones((), **fp32)
    bad = None  # a 0-d fp32 flag on home: 1 skips the step
    norm = None
    if num_items is not None:
        items = torch.empty((), **fp32)
        if isinstance(num_items, Tensor):
            items.copy_(num_items.detach().reshape(()))
        else:
            items.fill_(float(num_items))
        window.topology.average_(items)  # (data parallel: gradients are the group's mean, so the counts)
        bad = (~((items > 0) & torch.isfinite(items))).float()
        coef = coef / items
    elif window.topology.step_divisor != 1:  # (the window holds the group's sum: its mean, as num_items=N)
        coef = coef / torch.full((), float(window.topology.step_divisor), **fp32)
    if grad_scale is not None:
        coef = coef / grad_scale.to(home)
    if isinstance(found_inf, Tensor):
        flag = (found_inf.to(home) > 0).float()
        bad = flag if bad is None else torch.maximum(bad, flag)
    if max_grad_norm is not None or skip_nonfinite:
        # (over every rank's gradient, in a data-parallel topology)
        if active is None:
            total, any_inf = window.topology.norm_terms(window.ledger, window.flat_groups, home)
        else:
            total = sum_of_squares(window.flat_groups, active, home)
            any_inf = torch.zeros_like(total)
        # inf/nan anywhere makes the sum of squares non-finite too
        nonfinite = torch.maximum(any_inf.clamp(max=1), (~torch.isfinite(total)).float())
        norm = total.sqrt() * coef
        if max_grad_norm is not None:
            coef = coef * (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_
        if skip_nonfinite:
            bad = nonfinite if bad is None else torch.maximum(bad, nonfinite)
    scale = {d: coef.to(d) for d in devices}
    skip = {d: bad.to(d) for d in devices} if bad is not None else None
    return scale, skip, norm

"""The gradient window's state, with one owner, and its face in ``.grad``.

:class:`Ledger` holds what a window knows between two steps and what its decisions are taken
from. Per slot (fused_accum.flat.Slot): whether it holds this window's gradient (``has_grad``),
the view ``.grad`` shows (``grad_view``), the backward that last folded it (``folded_in``) and
whether step_in_backward stepped it (``stepped``). Per window: the count of backwards, whether
step_in_backward may step it or has, and what ``.grad`` shows. (The window's norm and non-finite
flag are not kept: the step takes them from the buffers' values, ``Topology.norm_terms``.)

**Whether a parameter has a gradient this window** is decided by one rule, for every topology:
``has_grad``. A fold sets it (a hook, a fused weight gradient written in place, FSDP2's
reduce-scatter taken), and so does a gradient taken whole (a ``.grad`` the user assigned, DDP's,
a checkpoint's); the user clearing ``.grad``, the window's end and a move of the buffers clear it.
Where the ranks reduce the window themselves (``process_group=``, ``shard=``, the exact wire), the
reduction makes it the group's: set where any rank's was (:meth:`Ledger.reduced`, from the
ranks' flags, agreed by one small all-reduce that goes with the reduction:
``fused_accum.distributed.WindowReducer.finish``), so every rank decides alike. A slot without
one is not stepped (its state, step count and master stay, as torch's optimizers skip a
parameter whose ``.grad`` is None), counts nothing in the norm, shows ``.grad`` None and saves no
``accum``.

Only the ledger's methods change them, each named for the event that changes them (a bucket
was folded, a gradient taken from the user, a ``.grad`` cleared, a backward ended, the window
stepped, ended, moved); everywhere else they are read (the slot's fields have no setter).
Every change of a slot's ``has_grad`` or ``grad_view`` adds one to the window's
change counter, an int64 the C++ hooks read too: a decision taken at a count (the fast-fold
grants, a quiet backward, the ``.grad`` exposure) holds while the count keeps its value. The
plan the hooks' table holds (fused_accum.arrivals.Plan: its flags, grants, quiet backwards) is
kept here, each field set as the consequence of an event, and handed to the table at once, or
once at the end of a :meth:`Ledger.planning` block (the window's start and end of a backward).
Reading a count never acts: the backwards the C++ hooks ran quietly are a running total of
theirs, in the counters' second int64, that reads add in.

:class:`Exposure` shows the window in ``.grad`` and takes back what the user did to it.
"""

from __future__ import annotations

import array
import contextlib
import functools
import operator
from typing import Optional

import torch
from torch import Tensor

from . import ops
from .arrivals import Plan, Report

HAS_GRAD, GRAD_VIEW = (
    operator.attrgetter(f"_{n}") for n in ("has_grad", "grad_view")
)  # (C-level getters, for the per-slot loops)
_UNLIMITED = 2**62  # quiet backwards armed where no coming backward is known to be the last


class Ledger:
    """The window's counts, norm and flag, and every slot's window state (see the module)."""

    def __init__(
        self,
        table,
        label: str,
        accum_steps: Optional[int],
        step_in_backward: bool,
        wants_stats: bool,
        last_needs_python: bool = False,
    ):
        self.table = table  # the hooks' table (fused_accum.arrivals)
        self.fast = table if table.fast else None  # ... where it acts on a plan's fast path
        self.label = label  # how errors name the optimizer
        self.wants_stats = wants_stats  # max_grad_norm or skip_nonfinite: the step takes the norm
        # the window's last backward needs Python (the placement takes each bucket: offload)
        self.last_needs_python = last_needs_python
        self.slots: list = []  # the window's, by key
        # [the change counter, the quiet backwards' total] (read and written by the C++ hooks)
        self.changes = array.array("q", [0, 0])
        self.plan = Plan(counters=self.changes)  # what the table holds, or will at the block's end
        self._planning = 0  # the depth of planning() blocks: the plan is handed at the outermost end
        self.accum_steps = accum_steps
        self.step_in_backward = step_in_backward
        self._microbatches = 0  # backwards in this window the window itself counted
        self._total = 0  # ... over the window's life (what Slot.folded_in holds)
        self._quiet_seen = 0  # the hooks' quiet total when last taken in
        self.pieces_seen = False  # some slot received two gradients in one micro-batch
        self.stepped_in_backward = False  # step_in_backward stepped this window already
        # step_in_backward may step this window: from construction, zero_grad() or a window
        # cleared whole, until step() (a backward after a step may be another model's: DCGAN)
        self.may_step_in_backward = step_in_backward
        self.shown = False  # .grad currently shows the window
        self.shown_at: Optional[int] = None  # the change count when .grad was last shown
        self._show = False  # .grad is to show the window: with the next plan handed

    def join(self, slots: list) -> None:
        """Slots of a new flat group: their changes count here."""
        for slot in slots:
            slot.changes = self.changes
        self.slots.extend(slots)
        self.shown_at = None

    def _changed(self) -> None:
        self.changes[0] += 1

    # --- counts ----------------------------------------------------------------------------

    def _quiet(self) -> int:
        return self.changes[1] - self._quiet_seen

    @property
    def microbatches(self) -> int:
        """Backwards in this window, the quiet ones included."""
        return self._microbatches + self._quiet()

    @property
    def total(self) -> int:
        """Backwards over the window's life."""
        return self._total + self._quiet()

    def last_backward(self) -> bool:
        """The backward now running ends the window (known only with accum_steps)."""
        return self.accum_steps is not None and self.microbatches == self.accum_steps - 1

    def _take_quiet(self) -> None:
        quiet = self._quiet()
        self._quiet_seen += quiet
        self._microbatches += quiet
        self._total += quiet

    def backward_ended(self) -> None:
        """A backward that reached the parameters ended: one more micro-batch."""
        self._take_quiet()
        self._microbatches += 1
        self._total += 1

    def _restart_count(self, microbatches: int = 0) -> None:
        self._take_quiet()
        self._microbatches = microbatches
        if self.plan.quiet_until:
            self._plan(quiet_until=0)  # (which backward is the last may have moved)

    def resumed(self, microbatches: int) -> None:
        """A checkpoint's window was loaded: its count of backwards."""
        self._restart_count(microbatches)

    def arm_quiet(self) -> None:
        """Let the C++ hooks run the coming backwards quietly, up to the window's last where
        offload steps it as it goes (the caller decided every bucket is granted an add), while
        the change counter keeps the value it has now."""
        steps = self.accum_steps
        budget = steps - 1 - self.microbatches if self.last_needs_python and steps is not None else _UNLIMITED
        if budget > 0:
            self._plan(quiet_until=self.changes[1] + budget, at=self.changes[0])

    # --- folds ---------------------------------------------------------------------------

    def folded(self, slots: list) -> None:
        """``slots`` received a gradient in this micro-batch."""
        now = self.total
        for slot in slots:  # (a per-slot loop of the last backward: stored fields, counted once)
            if slot._folded_in == now:
                self.pieces_seen = True  # a second piece in one micro-batch (reentrant checkpoint)
            slot._folded_in = now
            slot._has_grad = True
        if slots:
            self._changed()

    def folded_in_graph(self, slots: list) -> None:
        """A compiled graph folded one gradient into each of ``slots`` (fused_accum.compiled:
        one each, so no second piece to spot; nothing recorded where each held one already)."""
        if not all(map(HAS_GRAD, slots)):
            for slot in slots:
                slot._has_grad = True
            self._changed()

    def held_in_trace(self, slots: list, held: bool) -> None:
        """While Dynamo traces a compiled call (fused_accum.compiled): ``slots`` hold the
        window's gradient (or none) from here on in the graph, as its books will record when it
        runs. Written as Dynamo side effects, so a later call in the same graph decides from
        them; the books' own record (the change counter with it) is the truth."""
        for slot in slots:
            slot._has_grad = held

    def captured_first(self, slots: list) -> None:
        """``slots`` receive their first gradient of the window in the compiled backward being
        captured, already counted (compiled autograd: recorded before its graph runs)."""
        for slot in slots:
            slot._folded_in = self.total - 1
            slot._has_grad = True
        if slots:
            self._changed()

    def stepped_in_pass(self, slots: list) -> None:
        """step_in_backward stepped ``slots`` from their last gradient: nothing of theirs is left
        in the window."""
        now = self.total
        for slot in slots:
            slot._stepped = True
            slot._has_grad = False
            slot._folded_in = now
        self._changed()

    def stepped_the_rest(self) -> None:
        """step_in_backward stepped every slot left at the window's last backward."""
        for slot in self.slots:
            slot._has_grad = False
        self.stepped_in_backward = True
        self._changed()

    def took_grad(self, slot) -> None:
        """``slot`` holds a gradient taken whole (a user's ``.grad``, a checkpoint's, FSDP2's)."""
        slot._has_grad = True
        self._changed()

    def reduced(self, others) -> None:
        """The window's data-parallel reduction ended: every slot holds the group's gradient,
        and ``has_grad`` becomes the group's (the rule: see the module): ``others``, the slots
        this rank had no gradient for that another rank had, hold one now."""
        for slot in others:
            slot._has_grad = True
        self._changed()

    def cleared(self, slot) -> None:
        """``slot``'s gradient is gone (its ``.grad`` cleared, or never arrived under DDP)."""
        if slot._has_grad:
            slot._has_grad = False
            self._changed()

    def moved(self, slots) -> None:
        """``slots`` got new buffers (their parameters moved or were cast): no gradient left."""
        for slot in slots:
            slot._has_grad = False
        self._changed()

    def view_set(self, slot, view) -> None:
        """``.grad`` is to show ``view`` for ``slot`` (a new view, a sharded placeholder)."""
        slot._grad_view = view
        self._changed()

    # --- the window's end ----------------------------------------------------------------------

    def stepped(self) -> None:
        """The optimizer stepped: micro-batches are counted anew and the norm forgotten; until
        the next window is started, no backward steps in backward (it may be another model's)."""
        self._restart()
        self.may_step_in_backward = False

    def window_started(self) -> None:
        """A window starts (``zero_grad()``, or every gradient cleared): counted anew."""
        self._restart()
        self.may_step_in_backward = self.step_in_backward

    def _restart(self) -> None:
        self._restart_count()
        self.stepped_in_backward = False
        self.pieces_seen = False
        if self.step_in_backward:
            for slot in self.slots:
                slot._stepped = False

    def discarded(self) -> None:
        """Every gradient of the window is gone and no ``.grad`` shows a view: a new window."""
        self.shown = False
        self._plan(hide=False)  # a .grad the user sets now is added to by the next backward
        for slot in self.slots:
            slot._has_grad = False
        self._changed()
        self.window_started()

    # --- the hooks' plan (fused_accum.arrivals.Plan) -------------------------------------------

    def _plan(self, **fields) -> None:
        self.plan = self.plan._replace(**fields)
        if not self._planning:
            self._hand()

    def _hand(self) -> None:
        """Hand the table the plan, and ``.grad``'s views where the window is to show and
        something changed since it last did (else ``.grad`` shows it still: what the user
        changes, the next look finds, and the hooks leave ``.grad`` as they found it; a middle
        micro-batch saves a pass over every parameter)."""
        show = None
        if self._show and self.shown_at != self.changes[0]:
            show = (list(map(GRAD_VIEW, self.slots)), list(map(HAS_GRAD, self.slots)))
            self.shown_at = self.changes[0]
        self._show = False
        self.table.hand(self.plan, show)

    @contextlib.contextmanager
    def planning(self):
        """The plan's changes in the block are handed to the table once, at its end (the
        window's start and end of a backward: one call each)."""
        self._planning += 1
        try:
            yield
        finally:
            self._planning -= 1
            if not self._planning:
                self._hand()

    def reported(self, report: Report) -> None:
        """The table reported (fused_accum.arrivals.Report): the overwrite grants it used (the
        caller records what they filled) and the grants of the partly arrived buckets it handed
        back are no longer in its plan, nor here."""
        self.ungranted((*report.overwritten, *(b for b, _ in report.partial)))

    def ungranted(self, buckets) -> None:
        """The table dropped the grants of ``buckets`` (an overwrite used; gradients handed to
        the window, which folds them): so does the plan here, else the next one handed would
        grant them again."""
        if buckets and self.plan.grants:
            gone = set(buckets)
            self.plan = self.plan._replace(grants=tuple(g for g in self.plan.grants if g.bucket not in gone))

    def clear_table(self) -> None:
        """The table forgets every arrival, and its plan its grants and quiet backwards
        (``HookTable.clear``)."""
        self.table.clear()
        self.plan = self.plan._replace(grants=(), quiet_until=0)

    def granted(self, grants: tuple) -> None:
        """The fast folds the coming backward may do (the folder decided them)."""
        self._plan(grants=grants)

    def seen(self, task: int) -> None:
        """The window queued its own end callback for the backward now running (``task``),
        which then ends there (it is not quiet)."""
        self._plan(seen=task)

    def showing(self) -> None:
        """``.grad`` is to show the window (set by the table as the plan is handed): the next
        backward first takes what the user did to it (the window's checks), and its hooks hide
        the views before autograd could add into them."""
        self.shown = True
        self._show = True
        self._plan(slow=True, hide=True)

    def needs_checks(self) -> None:
        """The next backward calls the window's before_backward (its checks), whatever was armed."""
        self._plan(slow=True)

    def checked(self) -> None:
        """The window's checks ran for the backward about to take gradients."""
        self._plan(slow=False)

    def set_stands_aside(self, value: bool) -> None:
        """Another engine fills ``.grad`` (DDP, FSDP2): the hooks do nothing."""
        self._plan(stands_aside=value)

    def pending(self) -> bool:
        return any(map(HAS_GRAD, self.slots)) or self.table.has_arrivals()


class Exposure:
    """``.grad`` is the truth: after every backward each parameter with a gradient in the window
    shows its fp32 running sum in ``.grad``, a view of its accumulator slice (``show``), exactly
    where native accumulation would show one. Before the next backward, and before anything
    reads the buffers, ``reconcile`` takes what the user did to it: a ``.grad`` cleared since
    (``model.zero_grad()``) discards that parameter's window, one replaced by another tensor
    becomes its accumulated gradient; in-place edits (clipping, unscaling) already went into the
    buffer. The per-parameter work is the hooks' table's, one C++ pass each way: ``.grad`` set
    as the ledger hands its plan (``HookTable.hand``'s ``show``), the changes found by the
    window's look (``HookTable.look``), which compares with what was shown."""

    def __init__(self, ledger: Ledger, flat_groups: list, folder) -> None:
        self.ledger, self.table = ledger, ledger.table
        self.flat_groups = flat_groups  # (the window's list: it grows as groups are added)
        self.folder = folder  # (for the window's topology, which the window may replace there)

    def forget(self) -> None:
        self.ledger.shown_at = None  # new slots, views or nodes: show again

    def show(self) -> None:
        """``.grad`` of every parameter with a gradient in this window is to show its fp32 sum:
        set by the table as the ledger hands its next plan (at once, or at a planning block's end)."""
        if self.folder.topology.stands_aside:
            return  # .grad is autograd's (and DDP's or FSDP2's)
        self.ledger.showing()

    def reconcile(self, changed_keys, before_backward: bool = False) -> bool:
        """Take what the user did to a shown ``.grad`` since it was shown (``changed_keys``:
        the window's look). True when every gradient of the window is gone (all cleared): a
        new window starts."""
        ledger = self.ledger
        if not ledger.shown:
            return False
        changed = False
        for key in changed_keys:  # the .grad no longer what show() set
            slot = ledger.slots[key]
            grad = slot.param.grad
            if grad is slot.grad_view:
                if grad.data_ptr() == slot.acc.data_ptr():
                    continue
                # `p.grad.data = t` re-pointed the view itself: t is the gradient now, as with
                # torch; the view (no longer one of the buffer) is replaced by a new one.
                self.take_user_grad(slot, grad)
                ledger.view_set(slot, self.flat_groups[slot.flat_index].new_grad_view(slot))
                slot.param.grad = None if before_backward else slot.grad_view
                changed = True
                continue
            if grad is None:
                if slot.has_grad:
                    self.folder.topology.dropped(self.flat_groups, slot)
                changed |= slot.has_grad
                ledger.cleared(slot)
            else:
                self.take_user_grad(slot, grad)
                changed = True
                if before_backward:
                    slot.param.grad = None  # the next gradient is added by our kernels
        ledger.shown = not before_backward
        return changed and not any(map(HAS_GRAD, ledger.slots))

    def take_assigned_grads(self, changed_keys) -> None:
        """At a window's first backward: a ``.grad`` the user assigned since the window began
        (after ``zero_grad()``, or before any backward) is where native accumulation would add
        this backward's gradient: it becomes the slot's sum so far (``changed_keys``: the
        window's look)."""
        for key in changed_keys:  # (nothing is shown: every defined .grad is the user's)
            slot = self.ledger.slots[key]
            grad = slot.param.grad
            if grad is not None and grad is not slot.grad_view:
                self.take_user_grad(slot, self.flat_groups[slot.flat_index].user_grad(slot, grad))
                slot.param.grad = None  # the next gradient is added by our kernels

    def all_cleared(self) -> bool:
        """Whether the user cleared every ``.grad`` this window shows (``model.zero_grad()``):
        reconcile would then start a new window. Reads only."""
        slots = self.ledger.slots
        return self.ledger.shown and any(map(HAS_GRAD, slots)) and all(s.param.grad is None for s in slots)

    def zero_held(self) -> None:
        """``zero_grad(set_to_none=False)``: every gradient the window holds becomes zero."""
        for slot in self.ledger.slots:
            if slot.has_grad:
                slot.acc.zero_()

    def clear_all(self) -> None:
        """Every hooked parameter's ``.grad`` becomes None (``zero_grad()``)."""
        if not self.table.clear_grads():  # (in one C++ pass, unless detached)
            for slot in self.ledger.slots:
                slot.param.grad = None

    def take_user_grad(self, slot, grad: Tensor) -> None:
        """``grad`` (a tensor the user assigned) is ``slot``'s accumulated gradient now."""
        self.take_user_grads([(slot, grad)])

    @torch.no_grad()
    def take_user_grads(self, pairs: list) -> None:
        """Each ``(slot, grad)``'s ``grad`` (a tensor the user assigned, or autograd's under DDP)
        is its slot's accumulated gradient now: copied into the slices by one accumulate call
        per flat group (an overwrite: exact in fp32, whatever the gradients' dtype and strides),
        not one copy per parameter (DDP hands every gradient over at every step)."""
        topology = self.folder.topology
        if not topology.stands_aside and not self.ledger.microbatches:
            _refuse_traced_backward(self.ledger.label, pairs)
        by_flat: dict = {}
        for slot, grad in pairs:
            if grad.is_sparse:
                raise RuntimeError(f"parameter {slot.name} has a sparse .grad; sparse gradients are not supported")
            if slot.acc is not None and grad.numel() != slot.acc.numel():
                raise RuntimeError(
                    f"parameter {slot.name} has a .grad of {grad.numel()} elements, expected {slot.acc.numel()}"
                )
            if grad.dtype not in _FOLDED_DTYPES:  # (torch accepts any float .grad on a bf16/fp16 parameter)
                grad = grad.float()
            if not topology.take_user_grad(self.flat_groups, slot, grad):
                by_flat.setdefault(slot.flat_index, []).append((slot, grad))
            else:
                self.ledger.took_grad(slot)
        for flat_index, taken in by_flat.items():
            flat = self.flat_groups[flat_index]
            taken.sort(key=lambda pair: pair[0].offset)  # (accumulate takes increasing offsets)
            offsets = torch.tensor([slot.offset for slot, _ in taken], dtype=torch.int64)
            grads = [grad for _, grad in taken]
            ops.accumulate(flat.acc, offsets, grads, 1.0, True, None, None, flat.backend, plan=None)
            for slot, _ in taken:  # (recorded once its slice holds it)
                self.ledger.took_grad(slot)
        if by_flat:
            topology.added()


_FOLDED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the accumulate kernels read
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _refuse_traced_backward(label: str, pairs: list) -> None:
    """A low-precision ``.grad`` about to be taken as the user's, in a window that counted no
    backward, while Dynamo traces ``backward()`` (``torch._dynamo.config.trace_autograd_ops``):
    a backward traced into a compiled function writes ``.grad`` itself (autograd.grad, then
    ``.grad = g`` or ``.grad += g`` in the parameter's dtype) and runs no hook, so no
    gradient reached the window and ``.grad`` holds bf16/fp16 running sums (1.9e-2 to 3.1e-2
    from eager on a bf16 MLP and GPT, k = 4). That is refused here, where it would be taken.
    (An fp32 parameter's traced sums are the window's fp32 folds, in the same order: taken.
    A low-precision ``.grad`` the user assigns with no backward in the window, with that
    option on, is refused too: it cannot be told apart.)"""
    if not torch._dynamo.config.trace_autograd_ops:
        return
    lossy = [slot.name for slot, grad in pairs if grad.dtype in _LOW_PRECISION and slot.param.dtype in _LOW_PRECISION]
    if lossy:
        raise RuntimeError(
            f"{label}: {len(lossy)} parameter(s) ({', '.join(lossy[:3])}{', ...' if len(lossy) > 3 else ''}) "
            "hold a low-precision .grad that no backward of this window brought to the optimizer: with "
            "torch._dynamo.config.trace_autograd_ops = True, a backward() inside a torch.compile'd function is "
            "traced into the graph, which writes .grad itself and runs none of the optimizer's hooks, so the "
            "gradients were summed in the parameters' dtype instead of fp32. Turn on compiled autograd instead "
            "(torch._dynamo.config.compiled_autograd = True: the folds are captured in the backward graph), or "
            "call backward() outside the compiled function (or with trace_autograd_ops off), then step"
        )


_IS_NONE = functools.partial(operator.is_, None)  # (C-level: no Python call per gradient)

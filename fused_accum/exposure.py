"""``.grad`` is the truth: what the window shows in ``.grad``, and what it takes back from it.

After every backward each parameter with a gradient in the window shows its fp32 running sum
in ``.grad``: a view of its accumulator slice (``show``), exactly where native accumulation would
show a ``.grad``. From then on ``.grad`` is the truth, as with torch's optimizers: before the
next backward, and before anything reads the buffers, ``reconcile`` takes what the user did to
it. A ``.grad`` cleared since (``model.zero_grad()``) discards that parameter's window; one
replaced by another tensor becomes its accumulated gradient; in-place edits (clipping,
unscaling) already went into the buffer. The per-parameter work is the hooks' table's
(``arrivals.expose``, ``arrivals.changed``): one C++ pass, which remembers what it showed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .flat import GRAD_VIEW, HAS_GRAD, Slot


class Exposure:
    """Shows the window in ``.grad`` and takes the user's changes back into the buffers. It
    works on the window's slots and flat groups, through the hooks' table, and asks the folder
    (fused_accum.fold) for the topology and to invalidate the window's norm."""

    def __init__(self, folder, slots: list) -> None:
        self.folder = folder
        self.arrivals, self.flat_groups, self.changes = folder.arrivals, folder.flat_groups, folder.changes
        self.slots = slots  # (the window's list: it grows as groups are added)
        self.shown = False  # .grad currently shows the window
        self._shown_at: Optional[int] = None  # the change count when .grad was last shown

    def forget(self) -> None:
        self._shown_at = None  # new slots, views or nodes: show again

    def show(self) -> None:
        """Set ``.grad`` of every parameter with a gradient in this window to its fp32 sum."""
        if self.folder.topology.stands_aside:
            return  # .grad is autograd's (and DDP's or FSDP2's)
        self.shown = True
        # The next backward first takes what the user did to .grad (reconcile), and its hooks
        # then hide the views before autograd could add into them.
        self.arrivals.slow = self.arrivals.hide = True
        if self._shown_at == self.changes[0]:
            # No slot's has_grad or view was set since the last exposure, so .grad shows it
            # still: what the user changes, reconcile takes (setting has_grad), the hooks leave
            # .grad as they found it. A middle micro-batch saves a pass over every parameter.
            return
        self.arrivals.expose(list(map(GRAD_VIEW, self.slots)), list(map(HAS_GRAD, self.slots)))
        self._shown_at = self.changes[0]

    def reconcile(self, before_backward: bool = False) -> bool:
        """Take what the user did to a shown ``.grad`` since it was shown. True when every
        gradient of the window is gone (all cleared): a new window starts."""
        if not self.shown:
            return False
        changed = False
        for key in self.arrivals.changed():  # the .grad no longer what show() set
            slot = self.slots[key]
            grad = slot.param.grad
            if grad is slot.grad_view:
                if grad.data_ptr() == slot.acc.data_ptr():
                    continue
                # `p.grad.data = t` re-pointed the view itself: t is the gradient now, as with
                # torch; the view (no longer one of the buffer) is replaced by a new one.
                self.take_user_grad(slot, grad)
                self.flat_groups[slot.flat_index].renew_grad_view(slot)
                slot.param.grad = None if before_backward else slot.grad_view
                changed = True
                continue
            if grad is None:
                changed |= slot.has_grad
                slot.has_grad = False
            else:
                self.take_user_grad(slot, grad)
                changed = True
                if before_backward:
                    slot.param.grad = None  # the next gradient is added by our kernels
        self.shown = not before_backward
        if changed and not any(slot.has_grad for slot in self.slots):
            return True
        if changed:
            self.folder.invalidate_stats()  # the norm/flag described values that are gone
        return False

    def take_assigned_grads(self) -> None:
        """At a window's first backward: a ``.grad`` the user assigned since the window began
        (after ``zero_grad()``, or before any backward) is where native accumulation would add
        this backward's gradient: it becomes the slot's sum so far."""
        for key in self.arrivals.changed():  # (nothing is shown: every defined .grad is the user's)
            slot = self.slots[key]
            grad = slot.param.grad
            if grad is not None and grad is not slot.grad_view:
                self.take_user_grad(slot, self.flat_groups[slot.flat_index].local_grad(slot, grad))
                slot.param.grad = None  # the next gradient is added by our kernels

    def all_cleared(self) -> bool:
        """Whether the user cleared every ``.grad`` this window shows (``model.zero_grad()``):
        reconcile would then start a new window. Reads only."""
        return self.shown and any(map(HAS_GRAD, self.slots)) and all(slot.param.grad is None for slot in self.slots)

    def zero_held(self) -> None:
        """``zero_grad(set_to_none=False)``: every gradient the window holds becomes zero."""
        for slot in self.slots:
            if slot.has_grad:
                slot.acc.zero_()

    def clear_all(self) -> None:
        """Every hooked parameter's ``.grad`` becomes None (``zero_grad()``)."""
        if not self.arrivals.clear_grads():  # (in one C++ pass, unless detached)
            for slot in self.slots:
                slot.param.grad = None

    @torch.no_grad()
    def take_user_grad(self, slot: Slot, grad: Tensor) -> None:
        """``grad`` (a tensor the user assigned) is ``slot``'s accumulated gradient now."""
        if grad.is_sparse:
            raise RuntimeError(f"parameter {slot.name} has a sparse .grad; sparse gradients are not supported")
        topology = self.folder.topology
        if not topology.take_user_grad(self.flat_groups, slot, grad):
            slot.acc.copy_(grad.reshape(-1))
            topology.added()
        slot.has_grad = True
        slot.in_stats = False

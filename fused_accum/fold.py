"""Folding: the gradients that arrived for a bucket go into the flat fp32 accumulator.

The window (:mod:`fused_accum.window`) hands a bucket's gradients here when its hooks saw every
slot of it arrive, and what is left of partly filled buckets when a backward ends. A bucket is
one ``ops.accumulate`` call per kind: the window's first gradient of a slice overwrites it (so
no zeroing pass is needed), later ones add. With ``step_in_backward`` the window's last backward's
fold is the fused step instead. What each fold changes in the window's state is the ledger's to record
(:mod:`fused_accum.ledger`).

The fast path. Where a fold needs nothing of Python (nothing to reduce, no fused step, no
offloaded step, an extension backend) the window's hooks may fold a complete bucket themselves
(the plan's grants, fused_accum.arrivals.Plan), and may run whole middle backwards without
calling Python at all (its quiet backwards). Such a grant is decided from every slot's
``has_grad`` and ``grad_view``, and holds while the ledger's change counter keeps the value it
had then. What the hooks did comes back in their report (fused_accum.arrivals.Report), taken
here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import backends, ops
from .arrivals import Grant
from .flat import Bucket, FlatGroup
from .ledger import _IS_NONE, HAS_GRAD, Ledger


class WgradTarget(NamedTuple):
    """Where a gradient is written straight into its accumulator slice (a fused weight-gradient
    GEMM, fused_accum.nn; a parameter with a post-accumulate-grad hook)."""

    acc: Tensor  # fp32, shaped like the parameter: its accumulator slice
    overwrite: bool  # the window's first gradient of this slice: write, do not add
    backend: str  # the resolved backend of the parameter's flat group
    done: Callable[[], None]  # call right after writing: the slice has arrived for this backward


class Folder:
    """Folds buckets into the accumulators, and decides the hooks' fast path.

    It holds what folding needs and nothing above it: the hooks' table, the window's flat
    groups and ledger, the stepper (``step_in_backward``) and the topology (a staging buffer, a
    reduction to start)."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        flat_groups: list,
        stepper,
        topology,
        label: str,
        step_in_backward: bool,
        lock,
        placement,
    ) -> None:
        self.ledger = ledger
        self.table = ledger.table
        self.fast = ledger.fast  # the table's fast path, where it has one
        self.lock = lock  # the window's: hooks run on one autograd thread per device
        self.flat_groups = flat_groups  # (the window's list: it grows as groups are added)
        self.stepper = stepper
        self.topology = topology  # (the window replaces it once decided: see GradientWindow.topology)
        self.label = label
        self.step_in_backward = step_in_backward
        self.placement = placement  # where the step runs (fused_accum.placement)
        self.bucket_ids: list = []  # the hooks' bucket number -> (flat index, bucket index)
        # by bucket number: a key the Triton backend caches a bucket's launch plan under (ops'
        # plan=): the bucket's accumulator and offsets are fixed, only the gradients change
        self.plans: list = []
        # the change count when the fast folds were last decided, and what was decided
        self._granted_at: Optional[int] = None
        self._granted: tuple = ()  # of arrivals.Grant

    def add(self, flat: FlatGroup) -> None:
        """A flat group joins: its buckets get the hooks' next bucket numbers, and the hooks'
        table learns each slot's bucket and position."""
        first = len(self.bucket_ids)
        self.bucket_ids.extend((flat.index, b) for b in range(len(flat.buckets)))
        self.plans.extend(object() for _ in flat.buckets)
        self.forget_grants()
        position = {
            s.key: (first + b, pos) for b, bucket in enumerate(flat.buckets) for pos, s in enumerate(bucket.slots)
        }
        self.table.extend(
            [len(b.slots) for b in flat.buckets],
            [position[s.key][0] for s in flat.slots],
            [position[s.key][1] for s in flat.slots],
            [s.name for s in flat.slots],
        )

    def revoke_fast(self) -> None:
        """The grants were for the backward that ended (or raised)."""
        if self.ledger.plan.grants:
            self.ledger.granted(())

    def forget_grants(self) -> None:
        self._granted_at = None  # new slots, views or nodes: decide again

    # --- the fast path ------------------------------------------------------------------------

    def grant_fast_folds(self) -> bool:
        """Plan the hooks' fast folds for the backward about to run (handed with the rest of
        the plan): the buckets whose fold needs nothing of Python (see fused_accum.arrivals),
        an add where every slot holds this window's gradient (the middle micro-batches, and the
        last unless offload steps it as it goes), an overwrite where none does (the first). No
        reduction or fused step may read what the fold writes. An add records nothing in
        Python; the slots an overwrite fills are recorded after it (see take_report). True
        when every bucket is granted an add."""
        if self.fast is None:
            return False
        ledger = self.ledger
        if not self.topology.fast_folds or self.step_in_backward:
            self.revoke_fast()
            return False
        if ledger.last_backward() and ledger.last_needs_python:
            self.revoke_fast()
            return False  # the placement takes its buckets as they complete (offload)
        if self._granted_at != ledger.changes[0]:  # (else no slot's has_grad/view changed)
            grants = []
            for bucket_id, (flat_index, bucket_index) in enumerate(self.bucket_ids):
                flat = self.flat_groups[flat_index]
                bucket = flat.buckets[bucket_index]
                if not backends.fast_folds(flat.backend):
                    continue
                held = list(map(HAS_GRAD, bucket.slots))
                if all(held) or not any(held):
                    grants.append(Grant(bucket_id, flat.acc, bucket.offsets, not held[0]))
            self._granted = tuple(grants)
            self._granted_at = ledger.changes[0]
        ledger.granted(self._granted)
        return len(self._granted) == len(self.bucket_ids) and not any(g.overwrite for g in self._granted)

    def take_report(self, end: bool = False) -> tuple:
        """Take the hooks' report (fused_accum.arrivals.Report) and record what their granted
        overwrites filled: at the end of a backward (``end``: the partly arrived buckets are
        returned too), and first of all in every Python callback of a backward while an
        overwrite grant is out (a later gradient of those slots must be added, not written
        over)."""
        if not end and not any(g.overwrite for g in self.ledger.plan.grants):
            return ()  # (nothing the hooks did needs recording now)
        report = self.table.report(end)
        self.ledger.reported(report)
        for bucket_id in report.overwritten:
            flat_index, bucket_index = self.bucket_ids[bucket_id]
            self._folded(self.flat_groups[flat_index].buckets[bucket_index].slots)
        return report.partial

    def arm_quiet(self) -> None:
        """At the end of a backward: let the C++ hooks run the next ones without calling Python
        while each would do nothing here but count (fused_accum.arrivals): every bucket is
        granted an add (no reduction, no fused step), up to the window's last backward where
        offload steps that one as it goes, as long as the change counter keeps its value
        (no slot's state was set from Python since) and the count is not set."""
        if not self.topology.fast_folds or self.step_in_backward:
            return
        if self.grant_fast_folds():  # (for the next backward: the count is already up)
            self.ledger.arm_quiet()

    # --- folding ------------------------------------------------------------------------------

    def _folded(self, slots: list) -> None:
        self.ledger.folded(slots)
        self.topology.added()

    def bucket_complete(self, bucket_id: int, grads: list) -> None:
        """Every slot of a bucket has arrived in this backward: fold them (the hooks handed the
        bucket here without its grant, which is no longer in their plan)."""
        self.take_report()
        self.ledger.ungranted((bucket_id,))
        flat_index, bucket_index = self.bucket_ids[bucket_id]
        flat = self.flat_groups[flat_index]
        self.fold(flat, flat.buckets[bucket_index], grads, self.plans[bucket_id], complete=True)
        ledger = self.ledger
        if self.placement.hands_on_buckets and ledger.last_backward() and self.topology.final_at_bucket(ledger):
            self.placement.bucket_final(flat, bucket_index, ledger)  # (its sums are final)

    def flush(self) -> None:
        """Fold what arrived for buckets this backward did not complete."""
        for bucket_id, grads in self.take_report(end=True):
            flat_index, bucket_index = self.bucket_ids[bucket_id]
            flat = self.flat_groups[flat_index]
            self.fold(flat, flat.buckets[bucket_index], grads, self.plans[bucket_id])

    @torch.no_grad()  # (a double backward runs its hooks in grad mode: the sums keep no graph)
    def fold(self, flat: FlatGroup, bucket: Bucket, grads: list, plan, complete: bool = False) -> None:
        """Fold the gradients that arrived for ``bucket`` (``grads`` by position in it, None where
        nothing arrived as a tensor): one op call per (overwrite, add) kind, an accumulate, or on
        the window's last micro-batch with ``step_in_backward`` the fused step."""
        if any(map(_IS_NONE, grads)):  # (not `None in grads`: that compares tensors with ==)
            arrived = [(s, g) for s, g in zip(bucket.slots, grads) if g is not None]
            in_order, grads = [s for s, _ in arrived], [g for _, g in arrived]
        else:
            in_order = bucket.slots  # (accumulate takes increasing offsets: bucket order)
        if in_order:
            self._fold_arrived(flat, bucket, in_order, grads, plan)
        if complete:
            self.topology.bucket_complete(self.flat_groups, self.ledger, flat, bucket)

    def _fold_arrived(self, flat: FlatGroup, bucket: Bucket, in_order: list, grads: list, plan) -> None:
        ledger = self.ledger
        self._check_not_stepped(())
        if grads[0].device != flat.device:  # the model moved after the optimizer was built
            self.stepper.rehome(flat)
            ledger.moved(flat.slots)
        last = ledger.last_backward()
        fuse_step = ledger.may_step_in_backward and last and not ledger.pieces_seen
        # Partitioned before folding (a fold sets has_grad): the window's first gradient of a
        # slot overwrites it, later ones add. Usually a whole bucket is one kind.
        first = [not s.has_grad for s in in_order]
        if all(first) or not any(first):
            kinds = [(first[0], in_order, grads)]
        else:
            kinds = [
                (
                    kind,
                    [s for s, f in zip(in_order, first) if f is kind],
                    [g for g, f in zip(grads, first) if f is kind],
                )
                for kind in (True, False)
            ]
        for overwrite, slots, kind_grads in kinds:
            if fuse_step:
                self._check_not_stepped(slots)
                self.stepper.fused_step(flat, slots, flat.coef.fill_(1.0), None, kind_grads, overwrite)
                continue
            if self.topology.stage(flat, bucket, slots, kind_grads, plan):  # (shard="grads": staged for its collective)
                self._folded(slots)
                continue
            if len(slots) == len(bucket.slots):
                offsets = bucket.offsets
            else:
                offsets = torch.tensor([s.offset for s in slots], dtype=torch.int64)
            ops.accumulate(flat.acc, offsets, kind_grads, 1.0, overwrite, None, None, flat.backend, plan=plan)
            self._folded(slots)
        if fuse_step:
            ledger.stepped_in_pass(in_order)

    def _check_not_stepped(self, slots) -> None:
        """step_in_backward: no gradient may arrive once it stepped the window, nor for
        ``slots`` once it stepped them."""
        if self.ledger.stepped_in_backward:
            raise RuntimeError(
                f"{self.label}: step_in_backward already stepped this window after "
                f"{self.ledger.accum_steps} backward passes; call step() before the next backward"
            )
        if any(s.stepped for s in slots):
            raise RuntimeError(
                f"{self.label}: a parameter received a second gradient after "
                "step_in_backward stepped it (a layer reused under several "
                "checkpoint(use_reentrant=True) calls?); use step_in_backward=False"
            )

    # --- gradients written in place -------------------------------------------------------

    def takes_in_place(self, slot, topology, hooked: bool = False) -> bool:
        """Whether ``slot``'s gradient may be written straight into its slice now: not where the
        topology must see the gradient (DDP, FSDP2) or holds no full slice (shard="grads"), nor
        a weight-gradient GEMM's with step_in_backward (it steps a bucket from its gradients as
        tensors). A ``hooked`` parameter's may (fold_one): every gradient of it comes this way,
        so its bucket's step in backward leaves it to the end of the window's last backward,
        which steps it after its hooks edited it."""
        if self.step_in_backward and not hooked:
            return False
        return topology.in_place_ok(self.ledger, self.flat_groups[slot.flat_index])

    def in_place_target(self, slot) -> WgradTarget:
        """Where ``slot``'s gradient is to be written in place in the backward now running."""
        self._check_not_stepped([slot])
        self.take_report()
        # A gradient of this slot still waiting in the bucket (a tied weight's other use) is
        # folded later with add: has_grad is set by done() before that can happen.
        overwrite = not slot.has_grad

        def done() -> None:
            with self.lock:
                self._folded([slot])
                self.table.arrive_in_place(slot.key)  # may complete the bucket: a fold

        return WgradTarget(slot.full_view, overwrite, self.flat_groups[slot.flat_index].backend, done)

    @torch.no_grad()
    def fold_one(self, target: WgradTarget, grad: Tensor) -> None:
        """One slot's gradient, alone, into its slice: a parameter with a user's
        post-accumulate-grad hook, whose hook must see the sum at once."""
        if target.overwrite:
            target.acc.copy_(grad)
        else:
            target.acc.add_(grad)  # fp32 += the gradient upcast: what the kernels compute
        target.done()

    def step_the_rest(self) -> None:
        """step_in_backward, at the end of the window's last backward: the slots whose gradients
        all came before it step here (the rest stepped as their buckets completed); step() then
        only ends the window."""
        ones = {flat.device: flat.one for flat in self.flat_groups}
        self.placement.step_window(self.flat_groups, self.topology, self.stepper, ones, None)
        self.ledger.stepped_the_rest()

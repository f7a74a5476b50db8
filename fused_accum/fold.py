"""Folding: the gradients that arrived for a bucket go into the flat fp32 accumulator.

The window (:mod:`fused_accum.window`) hands a bucket's gradients here when its hooks saw every
slot of it arrive, and what is left of partly filled buckets when a backward ends. A bucket is
one ``ops.accumulate`` call per kind: the window's first gradient of a slice overwrites it (so
no zeroing pass is needed), later ones add. On the window's last backward the same pass adds
the final values to the window's norm and non-finite flag (:class:`Stats`), and with
``step_in_backward`` it is the fused step instead.

The fast path. Where a fold needs nothing of Python (no norm to take, nothing to reduce, no
fused step, an extension backend) the window's hooks may fold a complete bucket themselves
(``grant_fast``), and may run whole middle backwards without calling Python at all
(``arm_quiet``). What such a grant was decided from is every slot's ``has_grad``, ``in_stats``
and ``grad_view``; the window's change counter (``flat.change_counter``) counts each assignment
to them, and a decision holds while the counter keeps its value.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import backends, ops
from .flat import FOLDED_IN, HAS_GRAD, IN_STATS, Bucket, FlatGroup, assign_all, change_counter

_IS_NONE = functools.partial(operator.is_, None)  # (C-level: no Python call per gradient)
_UNLIMITED = 2**62  # quiet backwards armed where no coming backward is known to be the last


class WgradTarget(NamedTuple):
    """Where a gradient is written straight into its accumulator slice (a fused weight-gradient
    GEMM, fused_accum.nn; a parameter with a post-accumulate-grad hook)."""

    acc: Tensor  # fp32, shaped like the parameter: its accumulator slice
    overwrite: bool  # the window's first gradient of this slice: write, do not add
    backend: str  # the resolved backend of the parameter's flat group
    done: Callable[[], None]  # call right after writing: the slice has arrived for this backward


class Stats:
    """The window's norm and non-finite flag: per device, a found-inf flag and a sum of squares
    (0-d fp32 tensors the last accumulate pass adds into), and which of them are still valid."""

    def __init__(self) -> None:
        self._tensors: dict = {}  # device -> (found_inf, sumsq)
        self.versions: list = []  # the accumulators' versions when the last backward ended

    def tensors(self, device) -> tuple:
        if device not in self._tensors:
            self._tensors[device] = tuple(torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
        return self._tensors[device]

    def invalidate(self, slots) -> None:
        """Forget the norm and flag; the step takes them again from the buffers."""
        for slot in slots:
            if slot.in_stats:  # (an assignment counts: see flat.change_counter)
                slot.in_stats = False
        for found_inf, sumsq in self._tensors.values():
            found_inf.zero_()
            sumsq.zero_()

    @staticmethod
    def acc_versions(flat_groups) -> list:
        # Every .grad view shares its buffer's version counter, which any in-place write moves.
        return [flat.acc._version for flat in flat_groups]

    def complete(self, flat_groups, slots) -> dict:
        """device -> (found_inf, sumsq) over every gradient of the window: what the last
        accumulate pass did not see is added here, one ``_foreach_norm`` per flat group. A
        ``.grad`` edited in place since the last backward ended (``scaler.unscale_``,
        ``clip_grad_value_``, ``nan_to_num_``) moved its buffer's version counter: the values
        the last pass saw are gone, so everything is taken again from the buffers."""
        if self.acc_versions(flat_groups) != self.versions:
            self.invalidate(slots)
        for flat in flat_groups:
            missing = [s.acc for s in flat.slots if s.has_grad and not s.in_stats]
            if missing:
                _, sumsq = self.tensors(flat.device)
                sumsq.add_(torch.stack(torch._foreach_norm(missing)).square().sum())
                for slot in flat.slots:
                    slot.in_stats = slot.in_stats or slot.has_grad
        return {flat.device: self.tensors(flat.device) for flat in flat_groups}


class BackwardCount:
    """The window's count of backward passes: ``microbatches`` in this window, ``total`` over
    its life (never reset: what ``Slot.folded_in`` holds, so a new window needs no pass over the
    slots). Both include the backwards the C++ hooks ran quietly, which they count themselves:
    each read takes those over first."""

    def __init__(self, arrivals, accum_steps: Optional[int], changes) -> None:
        self._arrivals = arrivals
        self.accum_steps = accum_steps
        self._changes = changes
        self._microbatches = 0
        self._total = 0

    def _take_quiet(self) -> None:
        quiet = self._arrivals.take_quiet_backwards()
        if quiet:
            self._microbatches += quiet
            self._total += quiet

    @property
    def microbatches(self) -> int:
        self._take_quiet()
        return self._microbatches

    @microbatches.setter
    def microbatches(self, value: int) -> None:  # (a step starts anew; a checkpoint resumes)
        self._take_quiet()
        self._microbatches = value
        self._arrivals.arm_quiet(0, self._changes)  # (which backward is the last may have moved)

    @property
    def total(self) -> int:
        self._take_quiet()
        return self._total

    def add_one(self) -> None:
        self._take_quiet()
        self._microbatches += 1
        self._total += 1

    def last_backward(self) -> bool:
        """The backward now running ends the window (known only with accum_steps)."""
        return self.accum_steps is not None and self.microbatches == self.accum_steps - 1


class Folder:
    """Folds buckets into the accumulators, and decides the hooks' fast path.

    It holds what folding needs and nothing above it: the hooks' table (``arrivals``), the
    window's flat groups and count of backwards, the stepper (``step_in_backward``), the
    topology (a staging buffer, a reduction to start) and the window's change counter."""

    def __init__(
        self,
        *,
        arrivals,
        flat_groups: list,
        stepper,
        topology,
        label: str,
        accum_steps,
        step_in_backward: bool,
        wants_stats: bool,
        lock,
    ) -> None:
        self.arrivals = arrivals
        self.lock = lock  # the window's: hooks run on one autograd thread per device
        self.flat_groups = flat_groups  # (the window's list: it grows as groups are added)
        self.changes = change_counter()  # of the window's slots' has_grad, in_stats, grad_view
        self.count = BackwardCount(arrivals, accum_steps, self.changes)
        self.stepper = stepper
        self.topology = topology  # (the window replaces it once decided: see GradientWindow.topology)
        self.label = label
        self.step_in_backward = step_in_backward
        self.wants_stats = wants_stats
        self.stats = Stats()
        self.bucket_ids: list = []  # the hooks' bucket number -> (flat index, bucket index)
        # by bucket number: a key the Triton backend caches a bucket's launch plan under (ops'
        # plan=): the bucket's accumulator and offsets are fixed, only the gradients change
        self.plans: list = []
        self.pieces_seen = False  # some slot received two gradients in one micro-batch
        self.stepped_in_backward = False  # step_in_backward stepped this window already
        # step_in_backward may step this window: from construction, zero_grad() or a window
        # cleared whole, until step() (GradientWindow.after_step says why)
        self.may_step_in_backward = step_in_backward
        # the change count when the fast folds were last decided, and what was decided
        self._granted_at: Optional[int] = None
        self._granted: tuple = ([], [], [], [])

    def add(self, flat: FlatGroup) -> None:
        """A flat group joins: its slots count changes here, its buckets get the hooks' next
        bucket numbers, and the hooks' table learns each slot's bucket and position."""
        for slot in flat.slots:
            slot.changes = self.changes
        first = len(self.bucket_ids)
        self.bucket_ids.extend((flat.index, b) for b in range(len(flat.buckets)))
        self.plans.extend(object() for _ in flat.buckets)
        self.forget_grants()
        position = {
            s.key: (first + b, pos) for b, bucket in enumerate(flat.buckets) for pos, s in enumerate(bucket.slots)
        }
        self.arrivals.extend(
            [len(b.slots) for b in flat.buckets],
            [position[s.key][0] for s in flat.slots],
            [position[s.key][1] for s in flat.slots],
            [s.name for s in flat.slots],
        )

    def forget_grants(self) -> None:
        self._granted_at = None  # new slots, views or nodes: decide again

    def invalidate_stats(self) -> None:
        self.stats.invalidate(s for flat in self.flat_groups for s in flat.slots)

    def complete_stats(self) -> dict:
        """device -> (found_inf, sumsq) over every gradient of the window (Stats.complete; a
        topology whose buffers are sharded makes its own)."""
        stats = self.topology.stats(self.flat_groups, self.stats)
        if stats is not None:
            return stats
        return self.stats.complete(self.flat_groups, [s for flat in self.flat_groups for s in flat.slots])

    # --- the fast path ------------------------------------------------------------------------

    def grant_fast_folds(self) -> bool:
        """Let the hooks fold, without calling back, the buckets of the backward about to run
        whose fold needs nothing of Python (see fused_accum.arrivals): an add where every slot
        holds this window's gradient (the middle micro-batches, and the last unless it takes
        the norm), an overwrite where none does (the first). No slot may be in the window's
        norm yet, and no reduction or fused step may read what the fold writes. An add records
        nothing in Python; the slots an overwrite fills are recorded after it (see
        take_fast_overwrites). True when every bucket is granted an add."""
        self.arrivals.revoke_fast()
        if not self.topology.fast_folds or self.step_in_backward:
            return False
        if self.count.last_backward() and self.wants_stats:
            return False  # its fold also adds the final values to the window's norm and flag
        if self._granted_at != self.changes[0]:  # (else no slot's has_grad/in_stats/view changed)
            buckets, accs, offsets, overwrite = [], [], [], []
            for bucket_id, (flat_index, bucket_index) in enumerate(self.bucket_ids):
                flat = self.flat_groups[flat_index]
                bucket = flat.buckets[bucket_index]
                if not backends.fast_folds(flat.backend) or any(map(IN_STATS, bucket.slots)):
                    continue
                held = list(map(HAS_GRAD, bucket.slots))
                if all(held) or not any(held):
                    buckets.append(bucket_id)
                    accs.append(flat.acc)
                    offsets.append(bucket.offsets)
                    overwrite.append(not held[0])
            self._granted = (buckets, accs, offsets, overwrite)
            self._granted_at = self.changes[0]
        buckets, _, _, overwrite = self._granted
        if buckets:
            self.arrivals.grant_fast(*self._granted)
        return len(buckets) == len(self.bucket_ids) and not any(overwrite)

    def take_fast_overwrites(self) -> None:
        """Record what the hooks' granted overwrites filled: first of all in every Python
        callback of a backward (a later gradient of those slots must be added, not written
        over) and at its end."""
        for bucket_id in self.arrivals.take_overwritten():
            flat_index, bucket_index = self.bucket_ids[bucket_id]
            self.mark_folded(self.flat_groups[flat_index].buckets[bucket_index].slots, stats=False)

    def arm_quiet(self) -> None:
        """At the end of a backward: let the C++ hooks run the next ones without calling Python
        while each would do nothing here but count (fused_accum.arrivals): every bucket is
        granted an add (no norm to take, no reduction, no fused step), up to the window's last
        backward where that one takes the norm, as long as the change counter keeps its value
        (no slot's state was set from Python since) and the count is not set."""
        if not self.topology.fast_folds or self.step_in_backward:
            return
        if not self.grant_fast_folds():  # (for the next backward: the count is already up)
            return
        steps = self.count.accum_steps
        budget = steps - 1 - self.count.microbatches if self.wants_stats and steps is not None else _UNLIMITED
        if budget > 0:
            self.arrivals.arm_quiet(budget, self.changes)

    # --- folding ------------------------------------------------------------------------------

    def mark_folded(self, slots: list, stats: bool) -> None:
        """``slots`` received a gradient in this micro-batch; ``stats``: the fold added it to the
        window's norm and non-finite flag."""
        now = self.count.total
        stale = False  # a value in the norm/flag is no longer final
        entered = False  # some slot entered the norm/flag now
        for slot in slots:  # (the stored fields, counted once below: a per-slot loop of the last backward)
            if slot.folded_in == now:
                self.pieces_seen = True  # a second piece in one micro-batch (reentrant checkpoint)
                stale = True  # (then stats is False: see fold)
            elif slot._in_stats:
                stale = True
            elif stats:
                slot._in_stats = entered = True
            slot.folded_in = now
        if entered:
            slots[0].changes[0] += 1
        assign_all(slots, "has_grad", True)
        if stale:
            self.invalidate_stats()
        self.topology.added()

    def bucket_complete(self, bucket_id: int, grads: list) -> None:
        """Every slot of a bucket has arrived in this backward: fold them."""
        self.take_fast_overwrites()
        flat_index, bucket_index = self.bucket_ids[bucket_id]
        flat = self.flat_groups[flat_index]
        self.fold(flat, flat.buckets[bucket_index], grads, self.plans[bucket_id], complete=True)

    def flush(self) -> None:
        """Fold what arrived for buckets this backward did not complete."""
        self.take_fast_overwrites()
        for bucket_id, grads in self.arrivals.take_partial():
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
            self.topology.bucket_complete(self.flat_groups, self.count, flat, bucket)

    def _fold_arrived(self, flat: FlatGroup, bucket: Bucket, in_order: list, grads: list, plan) -> None:
        if self.stepped_in_backward:
            raise RuntimeError(
                f"{self.label}: step_in_backward already stepped this window after "
                f"{self.count.accum_steps} backward passes; call step() before the next backward"
            )
        if grads[0].device != flat.device:  # the model moved after the optimizer was built
            self.stepper.rehome(flat)
        last = self.count.last_backward()
        fuse_step = self.may_step_in_backward and last and not self.pieces_seen
        # On the window's last backward the values written are final: the same pass adds them
        # to the window's norm and non-finite flag (unless a reduction changes them after).
        local_stats = last and self.wants_stats and not self.topology.syncs(self.count)
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
                if any(s.stepped for s in slots):
                    raise RuntimeError(
                        f"{self.label}: a parameter received a second gradient after "
                        "step_in_backward stepped it (a layer reused under several "
                        "checkpoint(use_reentrant=True) calls?); use step_in_backward=False"
                    )
                self.stepper.fused_step(flat, slots, flat.coef.fill_(1.0), None, kind_grads, overwrite)
                continue
            staged = self.topology.staging_for(flat, bucket)
            if staged is not None:  # (shard="grads": reduce-scattered after the backward)
                relative = torch.tensor([s.offset - bucket.start for s in slots], dtype=torch.int64)
                ops.accumulate(staged, relative, kind_grads, 1.0, False, None, None, flat.backend, plan=plan)
                self.mark_folded(slots, False)
                continue
            now = self.count.total
            stats = local_stats and now not in map(FOLDED_IN, slots)
            found_inf, sumsq = self.stats.tensors(flat.device) if stats else (None, None)
            if len(slots) == len(bucket.slots):
                offsets = bucket.offsets
            else:
                offsets = torch.tensor([s.offset for s in slots], dtype=torch.int64)
            ops.accumulate(flat.acc, offsets, kind_grads, 1.0, overwrite, found_inf, sumsq, flat.backend, plan=plan)
            self.mark_folded(slots, stats)
        if fuse_step:
            for slot in in_order:
                slot.stepped = True
                slot.has_grad = False  # stepped from its last gradient: nothing left in the window
                slot.folded_in = self.count.total

    # --- gradients written in place -------------------------------------------------------

    def takes_in_place(self, slot, topology) -> bool:
        """Whether ``slot``'s gradient may be written straight into its slice now: not with
        step_in_backward (it steps a bucket from its gradients as tensors), nor where the
        topology must see the gradient (DDP, FSDP2) or holds no full slice (shard="grads")."""
        return not self.step_in_backward and topology.in_place_ok(self, self.flat_groups[slot.flat_index])

    def in_place_target(self, slot) -> WgradTarget:
        """Where ``slot``'s gradient is to be written in place in the backward now running."""
        self.take_fast_overwrites()
        # A gradient of this slot still waiting in the bucket (a tied weight's other use) is
        # folded later with add: has_grad is set by done() before that can happen.
        overwrite = not slot.has_grad

        def done() -> None:
            with self.lock:
                self.mark_folded([slot], stats=False)
                self.arrivals.arrive_in_place(slot.key)  # may complete the bucket: a fold

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
        for flat in self.flat_groups:
            self.stepper.fused_step(flat, [s for s in flat.slots if s.has_grad], flat.coef.fill_(1.0))
        for flat in self.flat_groups:
            assign_all(flat.slots, "has_grad", False)
            flat.masters_written()
        self.stepped_in_backward = True

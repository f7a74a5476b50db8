"""``offload="cpu"``: the optimizer's state on the host, the step on the host's CPU kernels, exact.

On the device stay the parameters and the fp32 accumulators (bf16 AdamW: 2 + 4 = 6 B/param;
with ``shard="grads"`` over N ranks 2 + 4/N; under FSDP2 each rank's shards of both, 6/N); the
middle micro-batches fold there exactly as without offload. On the host live the fp32 masters
(or, with ``master_weights="remainder"``, the int16 remainders), the optimizer state and the
step counts, a host copy of every parameter (what the step writes, and what goes back to the
device), the window's gradient as it arrives from the device, and, once a window speculates, a
twin of each buffer a step writes (the masters or remainders, the state, the parameter copy:
14 B/param for bf16 AdamW): :class:`fused_accum.host.HostLayout`, over the topology's layout,
which says what this process holds of each parameter (all of it; under ``shard=`` its part of
each bucket; under FSDP2 its local shards). The two that cross, the gradient and the parameter
copy, are pinned where the device is a GPU; the rest never does.

One transfer per window. When the window's last backward completes a bucket, its fp32 sum is
final: it goes device-to-host once (on a side stream), and a host worker thread steps that
bucket with the package's CPU kernels as soon as it lands, while the backward goes on. After the
step the updated parameters come back host-to-device per bucket, and the next forward waits on
exactly those copies (the compute stream waits on their events).

Speculation, and why it stays exact. Clipping and non-finite skips need the whole window's norm,
known only at its end, and ``num_items`` and a GradScaler's scale only at ``step()``. So the
worker steps each bucket *speculatively*, with the coefficient 1, and out of place: the step
reads the old values from the live buffers and writes the new ones into their twins
(``ops.StepTensors.sources``: the same pass and the same traffic as an in-place step; the live
buffers, which ``opt.state`` shows, are left as they were). At ``step()``, where the step's real
coefficient is 1 and nothing skips, and nothing the speculation read has changed since (the
gradients, the weights, ``opt.state``, the hyper-parameters), the speculation is the step: it is
committed as it is. Whether the gradients and the weights changed is decided from their values,
never from version counters (they miss ``.data`` writes, ``scaler.unscale_``,
``dist.all_reduce(p.grad)`` and our own folds of a backward past the last, and move on
``clip_grad_norm_``'s multiply by 1.0): a fingerprint of each bucket's accumulator range and
weights, its bits summed three ways (plain, squared, position-weighted) in exact int64 arithmetic
on the device, is taken when the bucket is sent and again at ``step()`` (a read of 4 + 2 B/param
on the device for bf16 weights), and the host reads the comparisons as one flag per bucket, in
one sync per window. Otherwise the bucket is stepped again from the live buffers, untouched
(nothing to put back but its step counts), with the real coefficient and skip flag: the same
kernels on the same values as a step taken after the window, bit for bit. No arithmetic
rollback anywhere. Every other bucket of such a window steps at ``step()`` out of place too;
the runs of slots that did not step this window are copied over from the live buffers (only
those); then each buffer and its twin swap their memory, in O(1)
(:func:`fused_accum.extension.swap_storages`: the two storages exchange their memory, so every
view of either, ``opt.state``'s included, sees the other's without an op per parameter; without
the C++ extension an honest swap by copies), and the weights go back to the device from the
now-live host copies. The twins are the "second host copy of the state" the design asks for: a
commit is a swap. Not of memory the user holds from outside (``share_memory_()`` on
``opt.state``, as A3C's shared Adam does; a NumPy view of a moment): such a buffer keeps its
memory and takes its twin's values by a copy (:meth:`HostLayout.commit`), so that what the user
holds keeps following ``opt.state``, as without offload. Once a flat group has twins (made by
its first speculation), every host step of it is out of place, in a window that did not
speculate too, and the swaps come after every bucket's step, in one task after them: a step()
that fails on the host leaves the weights, the state and the step counts as they were (the
worker runs nothing after a failed task), and the next step() steps the window. A flat group
none of whose windows speculated (under a process group, ``shard=``, FSDP2, or without
``accum_steps``: nothing speculates) makes no twins (14 B/param for bf16 AdamW) and steps in
place: a failure there cannot be undone, and step() says so.

What speculates: a window with ``accum_steps`` set (its last backward is known) when the step
before it was the speculation's: it used neither ``num_items`` nor a GradScaler (a loop that
does, does at every step), it neither clipped nor skipped, and nothing changed the gradients or
the weights after its last backward (a trainer's ``clip_grad_norm_`` that did not bind multiplies
by 1.0 and changes nothing: that window commits). Clipping comes in runs: after a window whose
step was not the speculation's, the next ones are only watched (their fingerprints taken, no
step) until one would have committed; the window after it speculates again. Every other window steps at
``step()``, still bucket by bucket, each bucket's copy to the host overlapping the step of the
one before; so does every window under ``process_group=`` (and ``shard=``), whose last
backward's buckets are final only after their collective, which the step waits for
(``fold.bucket_complete`` asks the topology: ``final_at_bucket``), under FSDP2, whose
reduce-scatters add into ``.grad`` until the last backward ends, and under DDP, which owns
``.grad``. A bucket holding a parameter with a post-accumulate-grad hook does not speculate (the
hook may edit ``.grad`` after the fold), nor does any bucket of an optimizer with step pre-hooks
(they run before the step and may edit ``opt.state``).

What the user sees meanwhile. The last backward returns once the host has stepped its buckets
(the worker ran alongside it; what is left is its last buckets), so nothing the user does after
it races the worker. Until ``step()``, ``opt.state`` shows the state before the step, as without
offload, step counts included (the speculated slots' counts are set back when the last
backward ends, and forward again at the commit). A checkpoint (``state_dict``) there holds the
state before the step (the speculation is dropped: the window then steps at ``step()``); an
entry assigned there is what the step takes (``Stepper.state_unchanged``: those buckets step
again); an in-place edit of it there (a moment, a step count) is seen through the version
counters of the live buffers' views, and that flat group's buckets step again, from the edited
state: bit for bit what the step without offload gives
(tests/test_offload.py::test_the_state_between_the_last_backward_and_step_is_the_state_before_the_step).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.optim import optimizer as torch_optimizer

from .host import Copies, HostLayout, Worker
from .owners import _foreign_step
from .placement import Placement

_HOST = torch.device("cpu")


@dataclasses.dataclass(eq=False)
class _Speculation:
    """One bucket of a window's last backward, as it was sent: what its step read (a fingerprint
    on the device, the hyper-parameters) and, where the worker stepped it speculatively (into
    the twins: the live buffers are as they were), its slots' step counts."""

    slots: list
    read: Tensor  # the bucket's fingerprint when it was sent (HostLayout.fingerprint)
    hyper: tuple
    index: Optional[Tensor] = None  # the slots' indices in the flat group's step counts
    steps: Optional[Tensor] = None  # their step counts after prepare_step; None: only watched
    counted: bool = False  # whether flat.steps holds them (until the last backward ends: see backward_ended)


class Offload(Placement):
    """The host placement of one optimizer under ``offload="cpu"``: its flat groups' layouts,
    the worker, the speculation of the window's last backward, and the host step (the fixed
    points: fused_accum.placement)."""

    hands_on_buckets = True  # (each bucket of the last backward is sent as it completes)
    compiled_autograd_refusal = "offload='cpu' (it steps each bucket on the host as the last backward completes it)"

    def __init__(self, stepper, owner) -> None:
        self.stepper = stepper
        self._owner = owner  # a weakref to the optimizer (its step pre-hooks)
        self.worker = Worker()
        self._finalizer = weakref.finalize(self, self.worker.stop)
        self._copies: dict = {}  # device -> Copies
        self.speculate = True  # (off after a step that was not the speculation's: see step)
        self.speculated: dict = {}  # (flat index, bucket index) -> _Speculation
        # flat index -> its buffers' versions (HostLayout.versions) once the speculation of
        # the window's last backward is done: what the user edits after moves them
        self._expected: dict = {}
        self.pending_h2d: list = []  # events the compute stream waits on after a step
        self._counted: list = []  # (flat, slots, found_inf) whose step counts step() added
        # buckets whose speculation was committed, and put back and stepped again (for logs, tests)
        self.committed = self.redone = 0

    def layout(self, device, base) -> HostLayout:
        """A new flat group's layout, over the topology's ``base`` (one process's, a rank's part
        of each bucket under ``shard=``, the local shards under FSDP2): host buffers pinned where
        the parameters are on a GPU."""
        pinned = torch.device(device).type == "cuda"
        if pinned:
            try:
                torch.empty(1, pin_memory=True)
            except RuntimeError as err:
                raise RuntimeError(
                    f"offload='cpu' keeps the optimizer state in pinned host memory, which this machine cannot give ({err})"
                ) from None
        return HostLayout(base, pinned)

    def copies(self, device) -> Copies:
        if device not in self._copies:
            self._copies[device] = Copies(device)
        return self._copies[device]

    # --- during the window's last backward ---

    def _may_speculate(self, bucket) -> bool:
        """What stops a speculation besides the last step (see the module): a user's
        post-accumulate-grad hook in the bucket (it may edit ``.grad`` in place after the fold,
        in this backward), and step pre-hooks (they run at ``step()``, before the step, and may
        read or edit ``opt.state``)."""
        if any(s.param._post_accumulate_grad_hooks for s in bucket.slots):
            return False
        owner = self._owner()
        return owner is not None and not owner._optimizer_step_pre_hooks and not _global_step_pre_hooks()

    def bucket_final(self, flat, bucket_index: int, ledger) -> None:
        """The window's last backward completed a bucket: its fold wrote the final sums. Take
        its fingerprint; where the window speculates, copy it to the host and step it there
        speculatively (see the module); else it is only watched, to tell at ``step()`` whether
        the next window may speculate."""
        bucket, key = flat.buckets[bucket_index], (flat.index, bucket_index)
        if key in self.speculated or ledger.pieces_seen or not self._may_speculate(bucket):
            return
        slots = [s for s in bucket.slots if s.has_grad]
        if not slots:
            return
        group = self.stepper.param_groups[flat.group_index]
        record = _Speculation(slots, flat.layout.fingerprint(flat, bucket_index), _hyper_of(group))
        self.speculated[key] = record
        if not self.speculate:
            return
        call = self.stepper.prepare_step(flat, slots, flat.one, None)
        if call is None:
            return
        record.index = torch.tensor([s.index for s in slots], dtype=torch.int64)
        # their step counts after prepare_step took any user's entry (as the step will see the
        # state) and added one to each
        record.steps, record.counted = flat.steps[record.index], True
        self._submit_step(flat, bucket_index, flat.layout.out_of_place(flat, slots, call))

    def backward_ended(self, flat_groups) -> None:
        """A backward ended. After the last one, wait for its speculation (the host has stepped
        while it ran: what is left is its last buckets), so that what the user does after it
        never races the worker; then the speculated slots' step counts go back to what they were
        (``opt.state`` shows the state before the step, counts included, as without offload),
        and the versions of what the user can edit are kept: an in-place edit after it is seen
        (``step`` redoes those buckets from the edited state)."""
        ended = {f for (f, _), record in self.speculated.items() if record.steps is not None}
        ended -= set(self._expected)
        if not ended:
            return
        self.worker.wait()
        for (flat_index, _), record in self.speculated.items():
            if flat_index in ended and record.counted:
                flat_groups[flat_index].steps[record.index] = record.steps - 1
                record.counted = False
        for flat_index in ended:
            self._expected[flat_index] = flat_groups[flat_index].layout.versions(flat_groups[flat_index])

    def _submit_step(self, flat, bucket_index: int, call) -> None:
        """Queue a bucket's step (out of place: live buffers into twins) on the worker, after its
        copies to the host (started here on a GPU; on a CPU the worker copies)."""
        layout = flat.layout
        hosts, devices = layout.fetch_lists(flat, bucket_index)
        event = self.copies(flat.device).to_host(hosts, devices)

        def task() -> None:
            if event is None and hosts:
                torch._foreach_copy_(hosts, devices)
            else:
                event.synchronize()
            call()

        self.worker.submit(task)

    # --- at step() ---

    def step_window(self, flat_groups, topology, stepper, scale: dict, skip: Optional[dict], speculable: bool) -> None:
        """The host step of every flat group: the speculation committed where it is the step,
        else stepped again from the live buffers; then the parameters back to the device, and the
        topology's after-step of them (``shard=``: the all-gather)."""
        edited = self._settle(flat_groups)
        coefs, skips, unchanged = self._read_back(flat_groups, scale, skip)
        for copies in self._copies.values():  # the parameters are rewritten after what reads them
            copies.after_compute()
        # the step is the speculation's: no clip, no num_items or scale, and nothing skipped
        as_sent = speculable and all(float(c) == 1.0 for c in coefs.values())
        as_sent = as_sent and (skips is None or not any(float(f) for f in skips.values()))
        self._counted = []
        try:
            steps = [
                self._step_flat(flat, topology, coefs, skips, unchanged, as_sent and flat.index not in edited)
                for flat in flat_groups
            ]
            self._finish(steps)
            self.worker.drain()
        except BaseException as error:
            # Nothing of a step that raised stands, as without offload: the worker ran no task
            # after the one that failed (host.Worker), so no twin was swapped in and no weight
            # sent; the counts this step added are taken back, and what was speculated has its
            # counts put back: the window steps at the next step(). (Not where a flat group has
            # no twins: see _in_place_failure.)
            in_place = self._uncount()
            self.discarded(flat_groups)
            if in_place and isinstance(error, Exception):
                raise RuntimeError(_in_place_failure(in_place)) from error
            raise
        self.committed += len(self.speculated)  # (what is left of the speculation is the step)
        self.speculated.clear()
        for device, event in self.pending_h2d:  # the next forward waits on these copies, no more
            torch.cuda.current_stream(device).wait_event(event)
        self.pending_h2d = []
        # The next window speculates only after a window whose step was the speculation's (or
        # would have been, where it was only watched): a loop that passes num_items or a scaler
        # passes them every step, and clipping comes in runs (a clipped window's speculation is
        # stepped again: two passes over the state instead of one). A window whose
        # clip did not bind (clip_grad_norm_ multiplied by 1.0) turns it back on.
        self.speculate = as_sent and all(unchanged.values())
        topology.after_step_params(flat_groups)

    def _step_flat(self, flat, topology, coefs: dict, skips: Optional[dict], unchanged: dict, as_sent: bool) -> tuple:
        """One flat group's host step: each speculated bucket committed (its step is in the
        twins; left in ``speculated`` until the whole step stands) or stepped again (the live
        buffers are as they were: nothing to put back but its counts), the rest stepped on the
        worker: out of place wherever the flat group has twins (made by its first speculation),
        so that the step stands only once every bucket's has (:meth:`_finish` swaps them in),
        else in place. Returns what :meth:`_finish` takes: (flat, twinned, the stepped slots'
        keys, the slots with a gradient)."""
        with_grad = [s for s in flat.slots if s.has_grad]
        active = {s.key for s in with_grad}
        topology.before_flat_step(flat, with_grad)
        # No twins where no window of this flat group speculated (a process group, FSDP2,
        # accum_steps=None: nothing speculates): there the steps are in place.
        twinned = bool(flat.layout.twin)
        stepped = set()
        for b in range(len(flat.buckets)):
            record = self.speculated.get((flat.index, b))
            if record is None:
                continue
            if record.steps is not None and as_sent and unchanged[(flat.index, b)] and self._still_valid(flat, record):
                stepped.update(s.key for s in record.slots)
                if not record.counted:  # its step counts, as its step took them
                    flat.steps[record.index] = record.steps
                    record.counted = True
                continue
            del self.speculated[(flat.index, b)]
            if record.steps is not None:
                self._put_back(flat, record)
                self.redone += 1
        coef = coefs[flat.device]
        found_inf = skips[flat.device] if skips is not None else None
        for b, bucket in enumerate(flat.buckets):
            slots = [s for s in bucket.slots if s.key in active and s.key not in stepped]
            if not slots:
                continue
            call = self.stepper.prepare_step(flat, slots, coef, found_inf)
            self._counted.append((flat, slots, found_inf))  # (prepare_step added to their counts)
            if call is not None:
                stepped.update(s.key for s in slots)
                self._submit_step(flat, b, flat.layout.out_of_place(flat, slots, call) if twinned else call)
        return flat, twinned, stepped, with_grad

    def _finish(self, steps: list) -> None:
        """After every flat group's steps, one task on the worker: the twins swapped in where
        the steps were out of place (:meth:`HostLayout.commit`), then the updated parameters sent
        back (into what the topology's before-step staged: ``shard=``'s buffer that its
        all-gathers spread). One task after all the steps, so that a step that fails leaves
        every flat group as it was: the worker runs nothing after a failed task."""
        sends = [(self.copies(flat.device), flat, with_grad) for flat, _, _, with_grad in steps if with_grad]
        for copies, _, _ in sends:
            copies.after_compute()  # (after the compute stream's staging of what the sends write into)

        def task() -> None:
            for flat, twinned, stepped, with_grad in steps:
                if twinned and with_grad:
                    flat.layout.commit(flat, stepped)
            for copies, flat, with_grad in sends:
                copies.to_device(*flat.layout.send_lists(flat, with_grad), self.pending_h2d)

        self.worker.submit(task)

    def _uncount(self) -> list:
        """After a failed step: take back the step counts it added where nothing of its step
        stands (the flat groups with twins). Returns the flat groups that stepped in place."""
        in_place = []
        for flat, slots, found_inf in self._counted:
            if not flat.layout.twin:
                in_place.append(flat)
                continue
            increment = flat.one if found_inf is None else 1 - found_inf
            index = flat.active_index(tuple(s.index for s in slots))
            flat.steps.index_add_(0, index, -increment.expand(len(slots)))
        self._counted = []
        return in_place

    def _read_back(self, flat_groups, scale: dict, skip: Optional[dict]) -> tuple:
        """What the host needs from the device, in one transfer per device (the window's one
        host sync, on one GPU): the step's coefficient and skip flag (the host kernels read
        them), and whether what each sent bucket's step read is as it was sent (its fingerprint
        taken again and compared there). Returns (coefficient per device, skip flag per device or
        None: 0-d host tensors; (flat index, bucket index) -> unchanged)."""
        coefs, skips, unchanged = {}, ({} if skip is not None else None), {}
        for device, coef in scale.items():
            keys = [(f, b) for f, b in self.speculated if flat_groups[f].device == device]
            parts = [coef.reshape(1).float()] + ([skip[device].reshape(1).float()] if skip is not None else [])
            for f, b in keys:
                now = flat_groups[f].layout.fingerprint(flat_groups[f], b)
                parts.append((now == self.speculated[(f, b)].read).all().reshape(1).float())
            packed = torch.cat(parts).to(_HOST)
            coefs[device] = packed[0]
            if skips is not None:
                skips[device] = packed[1]
            unchanged.update(zip(keys, (x == 1.0 for x in packed[len(parts) - len(keys) :].tolist())))
        return coefs, skips, unchanged

    def _settle(self, flat_groups) -> set:
        """Wait for the speculation (a failed one has its counts put back, and the error is
        raised). Returns the flat groups whose ``opt.state`` the user edited in place since the
        window's last backward (seen through the version counters of its buffers' views): their
        speculation read the state before the edit, so they step again, from the edited state,
        as without offload."""
        try:
            self.worker.drain()
        except RuntimeError:
            self.discarded(flat_groups)
            raise
        edited = {
            flat.index
            for flat in flat_groups
            if flat.index in self._expected and self._expected[flat.index] != flat.layout.versions(flat)
        }
        self._expected = {}
        return edited

    @staticmethod
    def _put_back(flat, record: _Speculation) -> None:
        """Undo a speculation: its slots' step counts (its values are in the twins only)."""
        if record.counted:
            flat.steps[record.index] = record.steps - 1
            record.counted = False

    def _still_valid(self, flat, record: _Speculation) -> bool:
        """Whether what a speculation read of the optimizer is as it was (its gradients and
        weights are compared by value: :meth:`_unchanged`): the active slots, ``opt.state``'s
        entries, the hyper-parameters."""
        group = self.stepper.param_groups[flat.group_index]
        return (
            all(s.has_grad for s in record.slots)
            and record.hyper == _hyper_of(group)
            and all(map(self.stepper.state_unchanged, record.slots))
        )

    def discarded(self, flat_groups) -> None:
        """Forget what was speculated (the window was discarded, a backward of it raised, or its
        state is about to be read whole: a checkpoint): its step counts put back (its values
        never reached the live buffers); its step then runs at ``step()``."""
        try:
            self.worker.drain()
        finally:  # (a task that failed is raised, after everything is put back)
            for (flat_index, b), record in self.speculated.items():
                if record.steps is not None:
                    self._put_back(flat_groups[flat_index], record)
            self.speculated.clear()
            self._expected = {}

    before_checkpoint = discarded  # (a checkpoint holds the state before this window's step)


def _in_place_failure(flat_groups: list) -> str:
    """What a failed step() leaves where flat groups stepped in place (no twins to keep the
    state before it)."""
    return (
        "fused_accum offload: the host step failed, and flat groups "
        f"{sorted({flat.index for flat in flat_groups})} step in place (none of their windows "
        "speculated, so they keep no second copy of their state: under a process group, shard=, "
        "FSDP2, or without accum_steps): part of their step stands (the buckets stepped before "
        "the failure; all their step counts moved on) and their weights were not sent to the "
        "device; resume from a checkpoint rather than stepping again"
    )


def _global_step_pre_hooks() -> bool:
    """Whether a user registered a step pre-hook for every optimizer (not counting the one this
    package registers: fused_accum.owners, which hands parameters between optimizers)."""
    hooks = getattr(torch_optimizer, "_global_optimizer_pre_hooks", {})
    return any(hook is not _foreign_step for hook in hooks.values())


def _value(v):
    """A hyper-parameter as a compared value: tensors by their values (also inside tuples)."""
    if isinstance(v, Tensor):
        return v.tolist()
    if isinstance(v, (tuple, list)):
        return type(v)(_value(x) for x in v)
    return v


def _hyper_of(group: dict) -> tuple:
    """A param group's hyper-parameters as compared values (a tensor lr or betas by value)."""
    return tuple((k, _value(v)) for k, v in sorted(group.items()) if k not in ("params", "param_names"))

"""Data parallelism for FusedAccumOptimizer: average the window's fp32 accumulators across a
process group once per optimizer step, not once per micro-batch.

DistributedDataParallel all-reduces every backward unless each micro-batch but the last runs
under ``no_sync()``; here the reduction belongs to the window by construction. Buckets are the
optimizer's own (each a contiguous range of a flat buffer): those completed during the window's
last backward are reduced asynchronously while the rest of that backward runs, the others when
it ends. The reduction is a sum divided by the world size (DDP's average), done on the fp32
accumulators, so no precision is lost in the collective either.

Sharded modes (``shard=``; their layout: :class:`fused_accum.topology.zero.ShardedLayout`):

- ``"state"`` (ZeRO-1 with a window-level reduction): the same buckets are reduce-scattered
  instead of all-reduced (in place: this rank's part of each bucket receives the group's mean),
  the step updates this rank's parts only, and :meth:`WindowReducer.gather_params` all-gathers
  the updated parameters in their own dtype. Wire bytes per window and parameter:
  4 (reduce-scatter, fp32) + the param's size (all-gather) times (N-1)/N, against the
  all-reduce's 8 x (N-1)/N.
- ``"grads"`` (ZeRO-2): every backward's buckets are reduce-scattered as they complete (in
  ``reduce_dtype``, fp32 by default) and folded into the 1/N accumulator when the backward ends.
- ``"grads"`` with ``reduce_dtype="exact"``: every backward's buckets go on the wire in the
  gradients' own dtype (bf16, fp16 or fp32) by an all-to-all, each rank receiving every rank's
  piece of its own part, and are folded into the fp32 shard accumulator in rank order by one
  ``ops.fold_pieces`` call per bucket (see :meth:`WindowReducer.stage`). The accumulators so hold
  the group's sum, added in the order one process would add the N x k micro-batches (micro-batch
  j, rank r); the step divides by N (``Topology.step_divisor``) and the norm is summed over
  fixed chunks (fused_accum.topology.base): the result does not depend on the world size.

The window's norm and non-finite flag are then sums of per-rank parts: one all-reduce of a
2-element tensor, on the device (no host sync).

DTensor parameters (FSDP2's ``fully_shard``) bring their own reduction: FSDP2 reduce-scatters
every micro-batch's gradient into the sharded parameter's ``.grad``, which the window takes
(fused_accum.topology.fsdp), and the window's norm and non-finite flag, computed from the local
shards, are summed over the mesh (:class:`ShardSums`). :func:`is_dtensor` and
:func:`local_tensor` tell such parameters apart and give their local shard.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .ledger import HAS_GRAD

# torch 2.13 renamed the flat-tensor collectives (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# reduce_dtype="exact": how many buckets' all-to-alls may be in flight before the oldest is
# waited for and folded (each holds its send buffer and its receive buffer, both the bucket's
# size in the wire dtype: with bf16 and 25 MB buckets of fp32-sized elements, 12.5 MB each)
EXACT_IN_FLIGHT = 2


def _all_to_all(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """Equal splits: ``input``'s i-th 1/N goes to rank i, rank j's lands in ``output``'s j-th."""
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor (about a second):
    no tensor can be one unless that module was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """What this rank stores of ``t``: a DTensor's local shard (for an FSDP2 parameter, a view
    of FSDP2's sharded storage, so in-place writes update the parameter), any other tensor itself."""
    if is_dtensor(t):
        with torch.no_grad():  # (to_local() is differentiable under grad mode: a plain alias here)
            return t.to_local()
    return t


def _alias(t: Tensor) -> Tensor:
    """A tensor over ``t``'s memory (same sizes, strides and offset) that is not a view of it:
    a collective's own views of it (gloo's all-gather chunks its output) reference the alias
    itself, not the base ``t`` came from, so the alias's use count alone shows whether anything
    but its Python object still holds it."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t)


class _Launched:
    """A collective in flight: its Work and the aliases it runs on (see :class:`Handoff`)."""

    __slots__ = ("work", "tensors")

    def __init__(self, work, tensors) -> None:
        self.work, self.tensors = work, tensors


def _wait_all(launched) -> None:
    for entry in launched:  # (a function of its own: no loop variable outlives the waits)
        entry.work.wait()


class Handoff:
    """Runs collectives and lets go of their tensors only after the backend has.

    ``Work.wait()`` returns as soon as gloo's worker thread marks a Work complete, but that
    thread still holds the Work, and through it the tensors (inputs, outputs, the future's value,
    its own views of the outputs), until it has done its bookkeeping and relocked its queue: a
    few microseconds, longer when it is preempted (2 to 3 of 144 waits in a row of training runs
    here still found it holding). A tensor whose Python object is dropped first stays alive on
    the C++ side, and its last release, then in the worker thread, takes the GIL to free the
    Python object; when that happens as the interpreter begins finalizing, CPython ends the
    thread (``pthread_exit``) inside a noexcept destructor: ``std::terminate``, "terminate
    called without an active exception", SIGABRT at exit. (Keeping every Work referenced a
    window longer avoided that, but kept each waited collective's buffers, the all-gathered
    parameters and ``shard="grads"``'s staging, alive as long.)

    So each collective runs on fresh aliases (:func:`_alias`) of the caller's tensors. Once
    waited, the Work is dropped at once (the memory it pins goes with it as soon as the worker
    thread lets go), and the aliases are kept until each one's use count is 1: its Python object
    alone, so neither the Work nor the worker thread holds it and the last reference, and the
    freeing, are ours, on this thread. With gloo that is a matter of microseconds, so
    :meth:`settle` waits for it (``patience`` seconds at most: past that, as with NCCL, whose
    watchdog thread keeps a Work until the device has run it, the aliases are checked again at
    every later call and, at the latest, at interpreter exit before finalizing begins).
    """

    _live: "weakref.WeakSet[Handoff]" = weakref.WeakSet()

    def __init__(self, group) -> None:
        self.group = group
        self.patience = 1.0 if dist.get_backend(group) == "gloo" else 0.0
        self._held: list = []  # aliases of waited collectives that something else may still hold
        Handoff._live.add(self)

    def launch(self, collective, *tensors, **kwargs) -> _Launched:
        """``collective(*tensors, group=..., async_op=True, **kwargs)`` on aliases of ``tensors``."""
        aliases = tuple(_alias(t) for t in tensors)
        return _Launched(collective(*aliases, group=self.group, async_op=True, **kwargs), aliases)

    def settle(self, launched: list) -> None:
        """Wait for every collective of ``launched`` (in order), then drop their Works and, once
        the backend has let go of them, their tensors (the list is emptied)."""
        _wait_all(launched)
        for entry in launched:
            self._held.extend(entry.tensors)
            entry.work, entry.tensors = None, ()
        launched.clear()
        self.release(self.patience)

    def release(self, patience: float = 0.0) -> None:
        """Drop the held aliases nothing else holds any more, waiting up to ``patience`` s for
        the rest (they stay held past it)."""
        deadline, pause = time.monotonic() + patience, 1e-5
        while True:
            self._held = [t for t in self._held if t._use_count() > 1]
            if not self._held or time.monotonic() >= deadline:
                return
            time.sleep(pause)  # (the worker thread needs no GIL to let go: our aliases are alive)
            pause = min(2 * pause, 1e-3)

    @property
    def holding(self) -> int:
        """How many tensors of finished collectives are still held (0 once all were let go)."""
        return len(self._held)


@atexit.register
def _let_go_before_exit() -> None:
    # atexit runs before the interpreter starts finalizing: the last releases can still happen
    # here, on this thread (the backend's threads finish their Works meanwhile); 10 s in all
    deadline = time.monotonic() + 10.0
    for handoff in list(Handoff._live):
        handoff.release(patience=max(0.0, deadline - time.monotonic()))


@torch.compiler.disable  # (never traced: a walk of the heap, from the window's first backward)
def ddp_wrapping(params) -> bool:
    """Whether a live DistributedDataParallel module wraps any of ``params``: it then fills and
    reduces ``.grad``, the window's hooks stand aside and the step takes ``.grad``.

    DDP reads each gradient in a hook on the AccumulateGrad node that runs after ours, so it
    must see autograd's ``.grad``. Asked once per optimizer, only once a process group exists (of
    any size: scripts that always wrap run DDP under ``torchrun --nproc_per_node=1`` too): it
    walks the objects the garbage collector tracks (tens of ms for a large program). It asks each
    object's ``type()``, not ``isinstance``, which reads ``__class__``: that raises ReferenceError
    on a ``weakref.proxy`` whose referent is gone, and one such proxy anywhere in the heap would
    make the walk raise.
    """
    params = list(params)
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p) for p in params}
    return any(
        issubclass(type(obj), DistributedDataParallel) and any(id(p) in wanted for p in obj._module_parameters)
        for obj in gc.get_objects()
    )


class ShardSums:
    """Sums a statistic of the local shards of DTensor ``params`` (the window's sum of squares
    and non-finite count) over the ranks holding the other shards, to the whole parameters':
    one all-reduce per mesh dimension along which they are sharded (FSDP2: its one dimension;
    HSDP: the shard dimension, replicas holding equal values).

    Sums only add up when every parameter is split the same way: all DTensors on one mesh,
    sharded along the same mesh dimensions (plain parameters, held whole by every rank, would
    be counted once per rank)."""

    def __init__(self, params) -> None:
        layouts = {
            (p.device_mesh, tuple(d for d, pl in enumerate(p.placements) if pl.is_shard())) if is_dtensor(p) else None
            for p in params
        }
        if len(layouts) != 1 or None in layouts:
            raise NotImplementedError(
                "max_grad_norm= and skip_nonfinite= with DTensor parameters need every trainable "
                "parameter to be a DTensor on one device mesh, sharded along the same mesh "
                "dimensions (as fully_shard on the root module leaves them); clip with "
                "torch.nn.utils.clip_grad_norm_ on .grad instead"
            )
        mesh, dims = layouts.pop()
        self.handoffs = [Handoff(mesh.get_group(d)) for d in dims]

    def sum_(self, value: Tensor) -> Tensor:
        """``value`` replaced by its sum over the shards, in place (no host sync)."""
        for handoff in self.handoffs:  # one after the other: each sums the last one's result
            handoff.settle([handoff.launch(dist.all_reduce, value)])
        return value


class WindowReducer:
    """All-reduces (sharded: reduce-scatters) the accumulator buckets; the window calls it.

    Collectives pair up by the order in which ranks issue them, so buckets are always launched
    in one fixed order (flat groups, then buckets: the order backward usually completes them).
    A bucket completed early waits for those before it; if a rank lacks a gradient that another
    has, the orders still agree.
    """

    def __init__(self, group, shard: Optional[str] = None, reduce_dtype: Optional[torch.dtype] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialized "
                "(call torch.distributed.init_process_group first)"
            )
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shard = shard  # None, "state" or "grads" (checked by the constructor's topology.check_arguments)
        self.exact = reduce_dtype == "exact"  # shard="grads": all-to-all in the gradients' dtype, rank-ordered fold
        self.reduce_dtype = torch.float32 if self.exact or reduce_dtype is None else reduce_dtype
        # reduce_dtype="exact": buckets staged in fp32 for good (a slot of theirs took two
        # gradients in one backward, or a gradient of another dtype than the parameters')
        self._fp32_buckets: set = set()
        self._seen: dict = {}  # reduce_dtype="exact": id(bucket) -> slot indices staged this backward
        # reduce_dtype="exact": bytes of the all-to-alls' buffers in flight now and at most
        # (send + receive), and bytes sent to other ranks ((N-1)/N of each send buffer)
        self.wire = {"in_flight": 0, "peak_in_flight": 0, "sent": 0}
        self._pending: list = []  # shard="grads": this backward's reduce-scatters, folded at its end
        self._staged: dict = {}  # shard="grads": id(bucket) -> this backward's staged gradients
        self._holds: set = set()  # shard="grads": buckets whose accumulator part holds this window's sum
        # NCCL averages in the collective; gloo has no AVG, so its sum is divided after (one
        # more pass over the buffer, 8 B per param per window).
        self._avg_op = getattr(dist.ReduceOp, "AVG", None) if dist.get_backend(group) == "nccl" else None
        self._works, self._ready, self._launched = [], set(), set()
        # Every collective goes through it: no tensor of ours outlives the backend's hold on it
        # in the backend's threads, and none is kept after (see Handoff).
        self.handoff = Handoff(group)
        self._mesh = None  # sharded checkpoints: the group as a 1-D DeviceMesh (see state_rows)
        self._ones: Optional[Tensor] = None  # the has-gradient flags where every slot has one (see _agree)

    @property
    def reducing(self) -> bool:
        """A reduction of this backward was begun and not ended: collectives launched, or
        gradients staged for them (shard="grads")."""
        return bool(self._launched or self._staged or self._pending)

    def bucket_ready(self, flat_groups, bucket) -> None:
        """``bucket`` holds its final local values: launch it and any ready ones after it."""
        self._ready.add(id(bucket))
        self._launch(flat_groups, only_ready=True)

    def finish(self, flat_groups) -> list:
        """Reduce what is left, wait for everything, and average. Afterwards every slot holds
        the group's gradient (zero where no rank had one); returned, the slots this rank had no
        gradient for that another rank had (:meth:`_agree`: which slots have one is the group's
        too, fused_accum.ledger)."""
        self._launch(flat_groups, only_ready=False)
        here, flags = self._agree(flat_groups)
        works, self._works = self._works, []
        self.handoff.settle(works)
        for flat in flat_groups:
            if self.exact:
                continue  # the accumulators keep the group's sum: the step divides (step_divisor)
            if self.shard == "grads":  # every backward's reduce-scatter was a sum (AVG would round each)
                flat.acc.div_(self.world)
            elif self._avg_op is None and self.shard is not None:
                for part in flat.layout.reduced_parts(flat):  # only this rank's parts hold the group's sum
                    part.div_(self.world)
            elif self._avg_op is None:
                flat.acc.div_(self.world)  # padding is zero: dividing the whole buffer is one pass
        self._ready, self._launched = set(), set()
        if all(here):
            return []  # (every slot had a gradient here, so in the group: nothing to read)
        slots = [s for flat in flat_groups for s in flat.slots]
        return [s for s, had, anyone in zip(slots, here, flags.tolist()) if anyone and not had]

    def _agree(self, flat_groups) -> tuple:
        """Launch the all-reduce (MAX) of a flag per slot of ``flat_groups``, 1 where this rank
        has a gradient this window: a slot has one in the group where any rank's has
        (fused_accum.ledger). Launched after every bucket, so every rank issues it at the same
        place in the fixed order, and waited for with them: one collective of 1 B per parameter
        per reduction, which adds no wait of its own. Returns (this rank's flags as bools, the
        flags' tensor). The host reads the result only where this rank lacks a gradient for
        some parameter (a layer frozen or skipped, an expert no token reached): one host read
        per reduction there, as DDP's find_unused_parameters=True pays for a parameter unused
        locally; never where every parameter has a local gradient (the steady state of most
        models: the flags are then a cached tensor of ones, whose MAX with anything is itself)."""
        here = list(map(HAS_GRAD, (s for flat in flat_groups for s in flat.slots)))
        if not here:
            return here, None
        device = flat_groups[0].acc.device
        if all(here):
            if self._ones is None or (self._ones.numel(), self._ones.device) != (len(here), device):
                self._ones = torch.ones(len(here), dtype=torch.uint8, device=device)
            flags = self._ones
        else:
            flags = torch.tensor(here, dtype=torch.uint8).to(device, non_blocking=True)
        self._works.append(self.handoff.launch(dist.all_reduce, flags, op=dist.ReduceOp.MAX))
        return here, flags

    def sum_(self, value: Tensor) -> Tensor:
        """``value`` replaced by its sum over the group, in place (no host sync)."""
        self.handoff.settle([self.handoff.launch(dist.all_reduce, value)])
        return value

    def gather_params(self, flat_groups) -> None:
        """Sharded, after the step: all-gather every flat group's staged parameters (one
        collective per bucket, fixed order) and copy them into the parameters."""
        works = []
        for flat in flat_groups:
            if flat.layout.staging is not None:
                for whole, part in flat.layout.gather_ranges(flat):
                    works.append(self.handoff.launch(_all_gather, whole, part))
        self.handoff.settle(works)  # (the staging buffers are only ours again after it)
        for flat in flat_groups:
            flat.layout.finish_step(flat)

    def state_rows(self, flat, slot, piece: Tensor) -> Tensor:
        """Sharded, for checkpoints: ``slot``'s 1-D ``piece`` (this rank's, of a master or state)
        as a DTensor of shape (world, longest piece) sharded by rows over the group, this rank's
        row holding its piece (zero padded). The ranks' pieces of a parameter have different
        lengths (where bucket parts split it), which no even DTensor sharding of the parameter
        expresses; rows are even, so torch.distributed.checkpoint saves each rank's piece (a
        plain tensor would be taken for a replicated one: one rank's piece for all) and loads it
        back at the same world size and layout. No communication."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.group, device_type=flat.device.type)
        longest = max(flat.layout.piece_lengths(flat, slot))
        # (on the group's device: under offload the piece is on the host)
        row = torch.zeros(1, longest, dtype=piece.dtype, device=flat.device)
        row[0, : piece.numel()] = piece
        return DTensor.from_local(
            row, self._mesh, [Shard(0)], run_check=False, shape=(self.world, longest), stride=(longest, 1)
        )

    def gather_full(self, flat, buf: Tensor) -> Tensor:
        """Sharded: the whole of a local (master or state) buffer of ``flat``, in the unsharded
        layout (``flat.total`` elements), all-gathered from every rank's parts (a collective:
        every rank calls it, in the same order)."""
        full = torch.zeros(flat.total, dtype=buf.dtype, device=flat.device)
        buf = buf.to(flat.device)  # (under offload it is on the host)
        works = []
        for bucket, (start, end, local_start) in zip(flat.buckets, flat.layout.parts):
            local = buf[local_start : local_start + end - start]
            works.append(self.handoff.launch(_all_gather, full[bucket.start : bucket.end], local))
        self.handoff.settle(works)
        return full

    # --- shard="grads": every backward --------------------------------------------------------

    def staging_for(self, flat, bucket) -> Tensor:
        """shard="grads": the fp32 buffer (the bucket's whole range) this backward's gradients
        of ``bucket`` are folded into before its collective: zeros where no gradient arrives, or
        with reduce_dtype="exact" -0.0, the additive identity (a rank without a gradient adds
        exactly nothing, not even to a -0.0). Freed once the collective is launched ("exact":
        its wire copy is) or done."""
        if not self._staged and not self._launched:
            # This backward's first bucket: what the backend still held of the last backward's
            # staging buffers (NCCL: until the device ran it) can go before allocating anew
            self.handoff.release()
        staged = self._staged.get(id(bucket))
        if staged is None:
            fill = -0.0 if self.exact else 0.0
            staged = torch.full((bucket.end - bucket.start,), fill, dtype=torch.float32, device=flat.device)
            self._staged[id(bucket)] = staged
            if self.exact:
                self._seen[id(bucket)] = set()
        return staged

    def wire_dtype(self, flat, bucket) -> torch.dtype:
        """reduce_dtype="exact": the dtype ``bucket`` goes on the wire in: its parameters' (what
        autograd produces for them), fp32 for fp32 parameters and for a bucket that once took
        a gradient its parameters' dtype cannot hold exactly (see :meth:`stage`)."""
        if id(bucket) in self._fp32_buckets or flat.dtype not in (torch.bfloat16, torch.float16):
            return torch.float32
        return flat.dtype

    @torch.no_grad()
    def stage(self, flat, bucket, slots: list, grads: list, plan=None) -> None:
        """shard="grads": fold this backward's ``grads`` of ``slots`` (in bucket order) into
        ``bucket``'s fp32 staging buffer (one ``ops.accumulate`` call), for its collective.

        reduce_dtype="exact": each element of the buffer so holds one gradient (or -0.0), a
        value of the gradient's dtype: the all-to-all sends the buffer in that dtype (one cast
        at launch, exact). Host ops stay per bucket, not per parameter: a staging buffer in
        bf16 would need a view per parameter to copy into (5 aten ops per parameter per
        backward, measured). A slot whose gradient arrives a second time into the same buffer,
        or a gradient of another dtype than its parameter's, makes a value the parameters'
        dtype cannot hold: that bucket goes on the wire in fp32 from then on (every backward of
        it, for good: every rank must see such a gradient in the same backward, running the
        same graph, since the all-to-all's buffers must agree in size). Such a parameter's sum
        is exact in fp32 but not the one-process sum bit for bit (one process adds its two
        gradients to the running sum one after the other; here their sum is added)."""
        relative = torch.tensor([s.offset - bucket.start for s in slots], dtype=torch.int64)
        staged = self.staging_for(flat, bucket)
        if self.exact and id(bucket) not in self._fp32_buckets:
            seen = self._seen[id(bucket)]
            keys = [s.index for s in slots]
            if any(k in seen for k in keys) or any(g.dtype != flat.dtype for g in grads):
                self._fp32_buckets.add(id(bucket))
            seen.update(keys)
        ops.accumulate(staged, relative, grads, 1.0, False, None, None, flat.backend, plan=plan)

    def bucket_staged(self, flat_groups, bucket) -> None:
        """``bucket`` received all of this backward's gradients: reduce-scatter it and any
        complete ones after it, in the fixed order (as ``bucket_ready``)."""
        self._ready.add(id(bucket))
        self._scatter(flat_groups, only_ready=True)

    def scatter_backward(self, flat_groups) -> None:
        """End of a backward: reduce-scatter every bucket not yet launched (zeros where this rank
        had no gradient: every rank issues one collective per bucket, in order), wait, and fold
        this rank's parts into the sharded accumulators (sums over ranks; :meth:`finish`
        averages at the window's end, or with reduce_dtype="exact" the step)."""
        self._scatter(flat_groups, only_ready=False)
        while self._pending:
            self._fold_oldest()
        # Gradients staged after their bucket's collective was launched in this backward (a
        # second completion of the bucket: a parameter inside and outside a reentrant
        # checkpoint, whose inner backward runs after the outer one completed the bucket): one
        # more collective for those buckets, in the fixed order, added like the first. Every
        # rank must have them for the same buckets (the same graph on every rank), as every
        # rank issues the same collectives.
        while self._staged:
            everything = {id(b) for flat in flat_groups for b in flat.buckets}
            self._launched = everything - set(self._staged)
            self._scatter(flat_groups, only_ready=False)
            while self._pending:
                self._fold_oldest()
        self._ready, self._launched = set(), set()

    def _fold_oldest(self) -> None:
        """Wait for the oldest collective of this backward and fold its result into this
        rank's part of the accumulator: the window's first overwrites (what the last window
        left), later ones add."""
        launched, part, flat, b = self._pending.pop(0)
        self.handoff.settle([launched])
        local_start = flat.layout.parts[b][2]
        bucket = flat.buckets[b]
        overwrite = id(bucket) not in self._holds
        self._holds.add(id(bucket))
        if self.exact:
            # part: [world, part] in the wire dtype, row r rank r's piece: summed in rank order
            target = flat.acc[local_start : local_start + part.shape[1]]
            ops.fold_pieces(target, list(part.unbind(0)), overwrite, flat.backend)
            self.wire["in_flight"] -= 2 * part.numel() * part.element_size()
            return
        target = flat.acc[local_start : local_start + part.numel()]
        if overwrite:
            target.copy_(part)  # the window's first: overwrite what the last window left
        else:
            target.add_(part)

    def new_window(self) -> None:
        """The window ended (stepped or discarded): the next reduce-scatter overwrites."""
        self._holds = set()

    def _scatter(self, flat_groups, only_ready: bool) -> None:
        if self.shard != "grads":
            return
        for flat in flat_groups:
            for b, bucket in enumerate(flat.buckets):
                if id(bucket) in self._launched:
                    continue
                if only_ready and id(bucket) not in self._ready:
                    return  # keep the fixed order
                if self.exact:
                    self._exchange(flat, b, bucket)
                    continue
                staged = self._staged.pop(id(bucket), None)
                if staged is None:
                    staged = torch.zeros(bucket.end - bucket.start, dtype=self.reduce_dtype, device=flat.device)
                elif staged.dtype != self.reduce_dtype:
                    staged = staged.to(self.reduce_dtype)
                part = torch.empty(staged.numel() // self.world, dtype=staged.dtype, device=staged.device)
                self._pending.append((self.handoff.launch(_reduce_scatter, part, staged), part, flat, b))
                self._launched.add(id(bucket))

    def _exchange(self, flat, b: int, bucket) -> None:
        """reduce_dtype="exact": launch ``bucket``'s all-to-all (its staging buffer as it is,
        -0.0 where this rank had no gradient), and fold the oldest one in flight once more than
        EXACT_IN_FLIGHT are."""
        staged = self._staged.pop(id(bucket), None)
        self._seen.pop(id(bucket), None)
        wire = self.wire_dtype(flat, bucket)
        if staged is None:
            send = torch.full((bucket.end - bucket.start,), -0.0, dtype=wire, device=flat.device)
        else:
            send = staged.to(wire)  # (exact: every element is a value of the wire's dtype)
        recv = torch.empty(self.world, send.numel() // self.world, dtype=send.dtype, device=send.device)
        self._pending.append((self.handoff.launch(_all_to_all, recv.view(-1), send), recv, flat, b))
        self._launched.add(id(bucket))
        size = send.numel() * send.element_size()
        self.wire["sent"] += size * (self.world - 1) // self.world
        self.wire["in_flight"] += 2 * size
        self.wire["peak_in_flight"] = max(self.wire["peak_in_flight"], self.wire["in_flight"])
        while len(self._pending) > EXACT_IN_FLIGHT:
            self._fold_oldest()

    def sum_chunks(self, flat, sums: Tensor) -> Tensor:
        """reduce_dtype="exact": every rank's chunk sums (``sums``: this rank's, in its local
        buffer order), all-gathered: [world, local chunks] (a collective)."""
        out = torch.empty(self.world, sums.numel(), dtype=sums.dtype, device=sums.device)
        self.handoff.settle([self.handoff.launch(_all_gather, out.view(-1), sums)])
        return out

    def average_(self, value: Tensor) -> Tensor:
        """``value`` (a 0-d device tensor) replaced by its mean over the group, in place; with
        reduce_dtype="exact" its sum (the accumulators hold the group's sum, not its mean)."""
        self.handoff.settle([self.handoff.launch(dist.all_reduce, value)])
        return value if self.exact else value.div_(self.world)

    def reset(self) -> None:
        """Forget a window discarded mid-reduction (its collectives still complete first)."""
        works, self._works = self._works, []
        self.handoff.settle(works + [entry[0] for entry in self._pending])
        self._pending, self._staged, self._holds, self._seen = [], {}, set(), {}
        self._ready, self._launched = set(), set()
        self.wire["in_flight"] = 0

    def _launch(self, flat_groups, only_ready: bool) -> None:
        if self.shard == "grads":
            return  # reduce-scattered every backward (scatter_backward)
        for flat in flat_groups:
            for b, bucket in enumerate(flat.buckets):
                if id(bucket) in self._launched:
                    continue
                if only_ready and id(bucket) not in self._ready:
                    return  # keep the fixed order: later buckets wait for this one
                # A slice this rank has no gradient for holds stale values: zero it.
                for slot in bucket.slots:
                    if not slot.has_grad:
                        slot.acc.zero_()
                segment = flat.acc[bucket.start : bucket.end]
                op = self._avg_op if self._avg_op is not None else dist.ReduceOp.SUM
                if self.shard is not None:  # in place: this rank's part receives the result
                    start, end, _ = flat.layout.parts[b]
                    part = flat.acc[start:end]
                    launched = self.handoff.launch(_reduce_scatter, part, segment, op=op)
                else:
                    launched = self.handoff.launch(dist.all_reduce, segment, op=op)
                self._works.append(launched)
                self._launched.add(id(bucket))

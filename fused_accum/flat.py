"""The flat fp32 buffers: where each parameter's accumulator, master copy and optimizer state live.

One :class:`FlatGroup` per (param group, device, param dtype) holds one fp32 buffer per role
(the gradient accumulator, the fp32 master of low-precision params, each optimizer state such
as ``exp_avg``) and a per-parameter step count. Each parameter owns a :class:`Slot`: an aligned
slice of every buffer. Buckets are runs of consecutive slots, so each is one contiguous range of
the buffer: the unit one accumulate call folds and one collective reduces.

Sharded modes (``shard="state"`` / ``"grads"``, see :class:`Sharding`): every bucket's range is
padded to a multiple of ``ALIGN * world`` and split into ``world`` equal contiguous parts; this
rank owns one part of each bucket (one ``reduce_scatter``/``all_gather`` per bucket, the bucket
being the collective's unit). The master and optimizer-state buffers then hold only the owned
parts, concatenated in buffer order (``local_numel = total / world`` elements), and each slot's
``piece`` says which elements of its parameter fall in them (a parameter split across ranks
gets a partial piece, one that lies elsewhere gets none). ``shard="grads"`` shards the
accumulator the same way. Without sharding the layout is exactly the unsharded one.

DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) are stored here by their local
shard (:func:`local_tensor`): the slices, masters and state cover what this rank holds, the step
updates the local shard in place (FSDP2's own storage), and :meth:`FlatGroup.state_view` wraps
the state back into DTensors of the parameter's mesh and placements, as torch.optim's is.

This layer knows nothing of hooks, windows or algorithms. It holds no reference cycles (slots
name their flat group and bucket by index), so an optimizer's buffers are freed the moment the
optimizer is, without waiting for the cyclic garbage collector.
"""

from __future__ import annotations

import array
import dataclasses
import operator
import sys
from typing import Optional

import torch
from torch import Tensor

ALIGN = 64  # elements: each slice starts 256 bytes into an fp32 buffer (16-byte vector loads, and 128-byte lines)
LOW_PRECISION = (torch.bfloat16, torch.float16)
# Partial active sets whose device index a flat group keeps (FlatGroup.active_index): the few a
# loop repeats (layers unused on some steps) stay cached; routing that picks a new set of
# experts most steps reuses none, and would otherwise grow the cache by one tensor per step.
ACTIVE_SETS_KEPT = 16
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION


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


def padded_offsets(numels) -> tuple[list[int], int]:
    """Where each of ``numels`` starts in a flat buffer whose slices are padded to ``ALIGN``,
    and the buffer's total size."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


@dataclasses.dataclass(frozen=True)
class Sharding:
    """This rank's part of a sharded flat group: ``mode`` is ``"state"`` (full accumulator,
    sharded master and state: ZeRO-1) or ``"grads"`` (accumulator sharded too: ZeRO-2)."""

    rank: int
    world: int
    mode: str


def bucket_members(numels, bucket_numel) -> list:
    """Slot indices of each bucket, buckets in reverse registration order (the order backward
    usually produces gradients), each bucket's indices increasing."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += numels[i]
        if size >= bucket_numel:
            buckets.append(current[::-1])
            current, size = [], 0
    if current:
        buckets.append(current[::-1])
    return buckets


def change_counter() -> array.array:
    """A gradient window's count of changes to its slots. What a window decides once and then
    reuses (the ``.grad`` exposure, the fast-fold grants, whether a backward may run without
    Python) depends on every slot's has_grad, in_stats and grad_view: every assignment to one of
    them adds one to the counter of the slot's window (``Slot.changes``), and a decision taken at
    a value holds while it stays. An int64 in an array because the C++ hooks read it too, at the
    start of a backward, without the GIL (fused_accum.arrivals)."""
    return array.array("q", [0])


_UNCOUNTED = change_counter()  # the counter of slots not (yet) in a window


def _counted(stored: str) -> property:
    """A Slot attribute kept in the field ``stored``, each assignment counted in the slot's
    window's counter (the getter is a C attrgetter: these are read in per-slot loops)."""

    def assign(slot, value) -> None:
        setattr(slot, stored, value)
        slot.changes[0] += 1

    return property(operator.attrgetter(stored), assign)


def assign_all(slots, name: str, value) -> None:
    """``slot.<name> = value`` for every slot of ``slots`` (a counted attribute; slots of one
    window), counted once: the per-parameter loops of a window's first backward and of
    ``zero_grad()``."""
    stored = "_" + name
    for slot in slots:
        setattr(slot, stored, value)
    if slots:
        slots[0].changes[0] += 1


# C-level getters, for the per-slot loops that read these
HAS_GRAD, IN_STATS, GRAD_VIEW = (operator.attrgetter(f"_{n}") for n in ("has_grad", "in_stats", "grad_view"))
FOLDED_IN = operator.attrgetter("folded_in")


@dataclasses.dataclass(eq=False, slots=True)
class Slot:
    """One parameter's place in its flat group, and its state in the current window.

    Every assignment to ``has_grad``, ``in_stats`` or ``grad_view`` (what the window's ``.grad``
    exposure and its fast-fold grants are decided from) is counted in ``changes``, its window's
    counter: a window that sees its count unchanged since it last decided need not decide
    again (and another optimizer's slots do not disturb it)."""

    param: Tensor
    name: str
    key: int  # position in the optimizer's list of all slots (what its hooks carry)
    flat_index: int  # which FlatGroup (position in the optimizer's list)
    index: int  # position in the flat group (and in its ``steps`` vector)
    offset: int  # where its slice of the flat buffers starts
    acc: Tensor  # 1-D fp32 view of the accumulator
    _grad_view: Tensor  # (grad_view) the same memory shaped like the param: what ``.grad`` is set to
    master: Optional[Tensor]  # 1-D fp32 master copy, for low-precision params with master weights
    state: dict  # optimizer state name -> 1-D fp32 view
    bucket_index: int = 0
    # --- the window (owned by fused_accum.window) ---
    _has_grad: bool = False  # (has_grad) the accumulator slice holds this window's gradient
    _in_stats: bool = False  # (in_stats) its final value is already in the window's norm / non-finite flag
    folded_in: int = -1  # the backward (window._backwards) that last folded it (to spot a second piece)
    stepped: bool = False  # step_in_backward already applied its update this window
    # --- sharded modes ---
    # (first, end, local offset): elements [first, end) of the flattened parameter are this
    # rank's, at [local, local + end - first) of the local (master/state) buffers; None: none are
    piece: Optional[tuple] = None
    full_view: Optional[Tensor] = None  # the accumulator slice shaped like the param (None: shard="grads")
    placeholder: Optional[Tensor] = None  # sharded: the ShardedGrad shown as .grad when no full gradient exists
    # the counter of the window the slot is in (change_counter); until then a shared one
    changes: array.array = dataclasses.field(default_factory=lambda: _UNCOUNTED)

    has_grad = _counted("_has_grad")
    in_stats = _counted("_in_stats")
    grad_view = _counted("_grad_view")


@dataclasses.dataclass(eq=False)
class Bucket:
    """Slots folded by one accumulate call; arrivals wait here until the bucket is complete."""

    slots: list  # consecutive slots, in flat-buffer order
    start: int = 0  # the bucket's slots cover flat buffer elements [start, end), padding included
    end: int = 0
    shard_start: int = 0  # sharded: this rank owns [shard_start, shard_end) of the bucket
    shard_end: int = 0
    local_start: int = 0  # ... stored at [local_start, local_start + shard_end - shard_start) locally
    offsets: Optional[Tensor] = None  # int64 on the CPU: each slot's offset, for accumulate
    # slot key -> its gradient so far in this backward (a parameter used both inside a
    # reentrant checkpoint and outside it receives two gradients in one backward: summed here)
    arrived: dict = dataclasses.field(default_factory=dict)
    # slot keys whose gradient this backward was written straight into the accumulator
    # (fused weight-gradient GEMM): they count as arrived but have nothing to fold
    in_place: set = dataclasses.field(default_factory=set)


class FlatGroup:
    """The flat fp32 buffers of the parameters of one param group, one device and one dtype."""

    def __init__(
        self,
        index,
        group_index,
        params,
        names,
        first_key,
        dtype,
        device,
        state_keys,
        master_weights,
        backend,
        bucket_numel,
        sharding: Optional[Sharding] = None,
    ):
        self.index, self.group_index = index, group_index
        self.dtype, self.device, self.backend = dtype, device, backend
        self.plan = object()  # names this group's buffers to the Triton backend's plan cache (ops plan=)
        self.sharding = sharding
        self.master_weights = master_weights
        self.has_master = dtype in LOW_PRECISION and master_weights
        self.has_dtensors = any(is_dtensor(p) for p in params)  # (FSDP2's: the step takes their local shards)
        numels = [local_tensor(p).numel() for p in params]
        members = bucket_members(numels, bucket_numel)
        world = sharding.world if sharding is not None else 1
        # Offsets in registration order; each bucket's end padded to ALIGN * world (a no-op
        # without sharding: slices are already padded to ALIGN).
        offsets, total, ranges = [0] * len(params), 0, {}
        for b in reversed(range(len(members))):
            start = total
            for i in members[b]:
                offsets[i] = total
                total += -(-numels[i] // ALIGN) * ALIGN
            total = -(-total // (ALIGN * world)) * ALIGN * world
            ranges[b] = (start, total)
        self.total = total
        self.local_numel = total // world
        fp32 = dict(dtype=torch.float32, device=device)
        local = self.local_numel
        self.acc = torch.zeros(local if self.shards_grads else total, **fp32)
        self.master = torch.zeros(local, **fp32) if self.has_master else None
        self.state = {key: torch.zeros(local, **fp32) for key in state_keys}
        self.steps = torch.zeros(len(params), **fp32)  # per-parameter step counts
        # float64, as torch's fused optimizers take lr: a Python float lr keeps every bit
        self.lr = torch.zeros((), dtype=torch.float64, device=device)
        self.coef = torch.ones((), **fp32)
        self.one = torch.ones((), **fp32)
        self.staging: Optional[Tensor] = None  # sharded: the params' all-gather buffer during a step
        self._index_cache: dict = {}  # active slot indices -> device index tensor (see active_index)
        self.slots = [
            Slot(p, name, first_key + i, index, i, off, None, None, None, {})
            for i, (p, name, off) in enumerate(zip(params, names, offsets))
        ]
        self.buckets = []
        for b, indices in enumerate(members):
            bucket = Bucket([self.slots[i] for i in indices], *ranges[b])
            bucket.offsets = torch.tensor([offsets[i] for i in indices], dtype=torch.int64)
            for slot in bucket.slots:
                slot.bucket_index = b
            self.buckets.append(bucket)
        local_start = 0
        for bucket in reversed(self.buckets):  # buffer order
            part = (bucket.end - bucket.start) // world
            rank = sharding.rank if sharding is not None else 0
            bucket.shard_start = bucket.start + rank * part
            bucket.shard_end = bucket.shard_start + part
            bucket.local_start = local_start
            local_start += part
        for slot in self.slots:
            self._set_views(slot)
            if slot.master is not None:
                slot.master.copy_(self.param_piece(slot))
        self._master_versions: Optional[list] = None  # the params' versions when the masters matched them
        self.masters_written()

    @property
    def shards_grads(self) -> bool:
        return self.sharding is not None and self.sharding.mode == "grads"

    def _set_views(self, slot: Slot) -> None:
        """Point ``slot``'s acc / grad_view / master / state at the buffers."""
        p, off = local_tensor(slot.param), slot.offset
        if self.sharding is None:
            window = slice(off, off + p.numel())
            slot.acc = self.acc[window]
            slot.grad_view = slot.full_view = slot.acc.view(p.shape)
            if is_dtensor(slot.param):  # FSDP2: .grad is a DTensor over this rank's fp32 slice
                from torch.distributed.tensor import DTensor

                q = slot.param
                slot.grad_view = DTensor.from_local(
                    slot.grad_view, q.device_mesh, q.placements, run_check=False, shape=q.shape, stride=q.stride()
                )
            slot.master = self.master[window] if self.has_master else None
            slot.state = {key: buf[window] for key, buf in self.state.items()}
            return
        bucket = self.buckets[slot.bucket_index]
        first = max(off, bucket.shard_start)
        end = min(off + p.numel(), bucket.shard_end)
        if first < end:
            local = bucket.local_start + first - bucket.shard_start
            slot.piece = (first - off, end - off, local)
            part = slice(local, local + end - first)
        else:
            slot.piece = None
            part = slice(0, 0)
        if self.shards_grads:  # no full accumulator: the piece of the sharded one
            slot.acc = slot.grad_view = slot.full_view = None
        else:
            slot.acc = self.acc[off : off + p.numel()]
            slot.grad_view = slot.full_view = slot.acc.view(p.shape)
        slot.master = self.master[part] if self.has_master else None
        slot.state = {key: buf[part] for key, buf in self.state.items()}

    def renew_grad_view(self, slot: Slot) -> None:
        """A new ``.grad`` view of ``slot``'s accumulator slice (the old one was re-pointed
        elsewhere through ``.data``)."""
        slot.grad_view = slot.full_view = slot.acc.view(slot.param.shape)

    def rehome(self, device, backend) -> None:
        """The parameters moved or were cast (``model.to(device)``, ``model.to(torch.bfloat16)``,
        or ``to_empty`` after building on the meta device): move the buffers after them. State
        and step counts move as they are (zeros when they were on the meta device); masters are
        copied from the parameters (a cast to bf16/fp16 gains one, a cast to fp32 drops it)."""

        def move(t):
            return torch.zeros_like(t, device=device) if t.is_meta else t.to(device)

        self.device, self.backend = device, backend
        self.dtype = self.slots[0].param.dtype
        self.has_master = self.dtype in LOW_PRECISION and self.master_weights
        self.acc = torch.zeros_like(self.acc, device=device)  # no gradient survives a move
        self.state = {key: move(buf) for key, buf in self.state.items()}
        self.steps, self.lr, self.coef, self.one = (move(t) for t in (self.steps, self.lr, self.coef, self.one))
        self.master = torch.zeros(self.local_numel, dtype=torch.float32, device=device) if self.has_master else None
        self._index_cache = {}
        self.plan = object()  # new buffers: a new launch plan
        for slot in self.slots:
            self._set_views(slot)
            if slot.master is not None:
                slot.master.copy_(self.param_piece(slot))
            slot.has_grad = slot.in_stats = False
        self.masters_written()

    def refresh_masters(self) -> None:
        """Re-read the fp32 master of every low-precision parameter written from outside since
        the optimizer last wrote it (``model.load_state_dict``, ``p.clamp_()``, ``nn.init``, an
        EMA swap: any in-place write moves the parameter's version counter). Without this the
        next step would write the stale master back over the user's weights. Called before
        anything reads the masters; one list comparison when nothing changed. Edits through
        ``p.data`` bypass the version counter, as they bypass autograd's own checks."""
        if not self.has_master:
            return
        versions = [s.param._version for s in self.slots]
        if versions == self._master_versions:
            return
        if self._master_versions is not None:
            for slot, now, then in zip(self.slots, versions, self._master_versions):
                if now == then or slot.master is None:
                    continue
                # A write of the values the master already rounds to (a checkpoint of the same
                # step, an EMA swapped back) keeps the master's precision.
                param = self.param_piece(slot)
                if not torch.equal(param, slot.master.to(param.dtype)):
                    slot.master.copy_(param)
        self._master_versions = versions

    def masters_written(self) -> None:
        """The optimizer just wrote the parameters from their masters: they agree again."""
        if self.has_master:
            self._master_versions = [s.param._version for s in self.slots]

    def step_lists(self, active: list) -> tuple:
        """(slots, accs, params, lp_params) the step op takes for ``active`` slots: without
        sharding, every active slot whole; sharded, the active slots holding a piece here, with
        1-D views of that piece: the reduced gradient, and as targets the fp32 master piece
        (lp target: the piece of :attr:`staging`) or, without a master, the staging piece
        itself. Sharded steps run between :meth:`begin_step` and :meth:`finish_step`."""
        if self.sharding is None:
            # Each param as it is (any strides: a channels_last weight cannot be viewed as 1-D);
            # the backends walk it in logical order, the order of its accumulator slice. Passed
            # as is, not detached (the step runs under no_grad, as torch's fused optimizers pass
            # theirs): a detach per parameter per step costs a microsecond each.
            params = [local_tensor(s.param) for s in active] if self.has_dtensors else [s.param for s in active]
            accs = [s.acc for s in active]
            return (active, accs, [s.master for s in active], params) if self.has_master else (active, accs, params, [])
        held = [s for s in active if s.piece is not None]
        accs, params, lps = [], [], []
        for slot in held:
            first, end, local = slot.piece
            acc = self.acc if self.shards_grads else slot.acc
            accs.append(acc[local : local + end - first] if self.shards_grads else acc[first:end])
            staged = self.staging[slot.offset + first : slot.offset + end]
            if self.has_master:
                params.append(slot.master)
                lps.append(staged)
            else:
                params.append(staged)
        return held, accs, params, lps

    def begin_step(self) -> None:
        """Sharded: stage this rank's pieces of the parameters (param dtype) for the step to
        update in place and the all-gather to spread (a skipped step leaves them as they were).
        Padding is left uninitialised: it is gathered but never copied into a parameter."""
        if self.sharding is None:
            return
        self.staging = torch.empty(self.total, dtype=self.dtype, device=self.device)
        held = [s for s in self.slots if s.piece is not None]
        if held:
            torch._foreach_copy_(
                [self.staging[s.offset + s.piece[0] : s.offset + s.piece[1]] for s in held],
                [s.param.detach().reshape(-1)[s.piece[0] : s.piece[1]] for s in held],
            )

    def gather_ranges(self) -> list:
        """Sharded: (whole bucket, this rank's part) views of :attr:`staging`, one per bucket,
        in the fixed bucket order: the all-gathers that spread the updated parameters."""
        return [(self.staging[b.start : b.end], self.staging[b.shard_start : b.shard_end]) for b in self.buckets]

    def finish_step(self) -> None:
        """Sharded, after the all-gathers: copy the gathered parameters into the params."""
        if self.staging is None:
            return
        staging, self.staging = self.staging, None
        torch._foreach_copy_(
            [s.param.detach() for s in self.slots],
            [staging[s.offset : s.offset + s.param.numel()].view(s.param.shape) for s in self.slots],
        )

    def shard_grads(self) -> list:
        """Sharded: 1-D views of the reduced gradient this rank owns (one per bucket), what
        its share of the window's norm and non-finite flag is computed from."""
        if self.shards_grads:
            return [self.acc]
        return [self.acc[b.shard_start : b.shard_end] for b in self.buckets]

    def param_piece(self, slot: Slot) -> Tensor:
        """The elements of ``slot``'s parameter (flattened, detached) whose master and state
        this rank holds: all of them without sharding (a DTensor's: its local shard)."""
        flat = local_tensor(slot.param.detach()).reshape(-1)
        if self.sharding is None:
            return flat
        return flat[slot.piece[0] : slot.piece[1]] if slot.piece is not None else flat[:0]

    def local_grad(self, slot: Slot, grad: Tensor) -> Tensor:
        """A ``.grad`` as this group stores it: for a DTensor parameter, the local shard of its
        gradient in the parameter's placements (FSDP2's is already; a Partial one from tensor
        parallelism is reduced first, as torch.optim's DTensor arithmetic would)."""
        p = slot.param
        if not is_dtensor(grad):
            return grad
        if grad.placements != p.placements or grad.device_mesh != p.device_mesh:
            grad = grad.redistribute(p.device_mesh, p.placements)
        return local_tensor(grad)

    def piece_lengths(self, slot: Slot) -> list:
        """Sharded: how many elements of ``slot``'s parameter each rank's piece holds (by rank)."""
        bucket, n = self.buckets[slot.bucket_index], local_tensor(slot.param).numel()
        part = (bucket.end - bucket.start) // self.sharding.world
        starts = [bucket.start + r * part for r in range(self.sharding.world)]
        return [max(0, min(slot.offset + n, s + part) - max(slot.offset, s)) for s in starts]

    def local_value(self, slot: Slot, value: Tensor) -> Tensor:
        """A loaded state value for ``slot`` as this group stores it: a DTensor's local shard
        (placed as the parameter is); for a DTensor parameter, a plain tensor of the whole
        parameter's shape (torch's full state dict, an unsharded optimizer's) is cut to this
        rank's shard without communication; anything else is taken as it is."""
        p = slot.param
        if is_dtensor(value) and self.sharding is not None:  # this rank's row (see state_rows)
            return local_tensor(value).reshape(-1)[: self.piece_lengths(slot)[self.sharding.rank]]
        if is_dtensor(value):
            return self.local_grad(slot, value)
        if is_dtensor(p) and value.shape == p.shape and value.shape != local_tensor(p).shape:
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: every rank cuts its own shard of the value it holds
            return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
        return value

    def piece_of(self, slot: Slot, value: Tensor) -> Tensor:
        """A loaded 1-D ``value`` for ``slot``'s master or state: sharded, a whole parameter's
        worth (torch's shape, e.g. from ``gathered_state_dict`` or an unsharded optimizer) is cut
        to this rank's piece; a piece's worth (this rank's own ``state_dict``) is taken as is."""
        if self.sharding is None or value.numel() != slot.param.numel():
            return value
        return value[slot.piece[0] : slot.piece[1]] if slot.piece is not None else value[:0]

    def state_view(self, slot: Slot, buf: Tensor) -> Tensor:
        """``buf`` (a slot's master or state view) as ``opt.state`` shows it: shaped like the
        parameter, or sharded, the 1-D piece this rank holds (possibly empty). For a DTensor
        parameter a DTensor over ``buf`` (no copy: in-place edits go through) with the
        parameter's mesh, placements and global shape, as torch.optim keeps its state."""
        if self.sharding is not None:
            return buf
        p = slot.param
        if is_dtensor(p):
            return type(p).from_local(
                buf.view(local_tensor(p).shape),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        return buf.view(p.shape)

    def ensure_state(self, key: str) -> bool:
        """Allocate an optimizer state buffer first needed after construction (momentum turned
        on, amsgrad enabled by editing a param group); True when it was allocated now."""
        if key in self.state:
            return False
        self.state[key] = torch.zeros(self.local_numel, dtype=torch.float32, device=self.device)
        for slot in self.slots:
            self._set_views(slot)
        return True

    def active_index(self, indices: tuple) -> Tensor:
        """A device tensor of slot ``indices`` (a partial active set), made once per distinct
        set: no host-to-device copy inside later steps (and none under CUDA-graph capture)."""
        cache = self._index_cache
        index = cache.pop(indices, None)
        if index is None:
            index = torch.tensor(indices, dtype=torch.int64, device=self.device)
            if len(cache) >= ACTIVE_SETS_KEPT:  # (MoE routing: a new set most steps)
                del cache[next(iter(cache))]  # the least recently used
        cache[indices] = index  # (most recent last)
        return index

    def nbytes(self) -> int:
        """Bytes of fp32 held by this group's buffers (accumulator, master, state, steps)."""
        buffers = [self.acc, self.steps] + list(self.state.values())
        if self.master is not None:
            buffers.append(self.master)
        return sum(b.numel() * b.element_size() for b in buffers)

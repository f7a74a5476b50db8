"""The flat fp32 buffers: where each parameter's accumulator, master copy and optimizer state live.

One :class:`FlatGroup` per (param group, device, param dtype) holds one fp32 buffer per role
(the gradient accumulator, the fp32 master of low-precision params, each optimizer state such
as ``exp_avg``) and a per-parameter step count. Each parameter owns a :class:`Slot`: an aligned
slice of every buffer. Buckets are runs of consecutive slots, so each is one contiguous range of
the buffer: the unit one accumulate call folds and one collective reduces.

Where the slices lie is the group's :class:`Layout`: here, one process's, every slice whole.
A mode that lays the buffers out otherwise brings its own, handed to the group by its topology:
a rank's part of each bucket (``shard=``, fused_accum.topology.zero), the local shards of
DTensor parameters (FSDP2, fused_accum.topology.fsdp).

This layer knows nothing of hooks, windows or algorithms. It holds no reference cycles (slots
name their flat group and bucket by index), so an optimizer's buffers are freed the moment the
optimizer is, without waiting for the cyclic garbage collector.
"""

from __future__ import annotations

import array
import dataclasses
import operator
from typing import Optional

import torch
from torch import Tensor

from . import masters
from .masters import LOW_PRECISION

ALIGN = 64  # elements: each slice starts 256 bytes into an fp32 buffer (16-byte vector loads, and 128-byte lines)
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION
# Partial active sets whose device index a flat group keeps (FlatGroup.active_index): the few a
# loop repeats (layers unused on some steps) stay cached; routing that picks a new set of
# experts most steps reuses none, and would otherwise grow the cache by one tensor per step.
ACTIVE_SETS_KEPT = 16


def padded_offsets(numels) -> tuple[list[int], int]:
    """Where each of ``numels`` starts in a flat buffer whose slices are padded to ``ALIGN``,
    and the buffer's total size."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


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


_UNCOUNTED = array.array("q", [0])  # the change counter of slots not (yet) in a window
_WEIGHT, _PARAM = operator.attrgetter("weight"), operator.attrgetter("param")  # (C-level: stale_weights)


def _read_only(stored: str) -> property:
    """A Slot field of the window's state, kept in ``stored``: read here, written only by the
    window's ledger (fused_accum.ledger), which counts each change (a C attrgetter: these are
    read in per-slot loops)."""
    return property(operator.attrgetter(stored))


@dataclasses.dataclass(eq=False, slots=True)
class Slot:
    """One parameter's place in its flat group, and its state in the current window.

    The window's fields (``has_grad``, ``grad_view``, ``folded_in``, ``stepped``) are read-only
    here: the window's ledger (fused_accum.ledger) is their one writer, and counts each change of
    the first two in ``changes``, its window's counter (the layout sets
    ``grad_view`` when it makes a slot's views: before the slot joins a window, or when the
    group moves, which the mover tells the ledger)."""

    param: Tensor
    name: str
    key: int  # position in the optimizer's list of all slots (what its hooks carry)
    flat_index: int  # which FlatGroup (position in the optimizer's list)
    index: int  # position in the flat group (and in its ``steps`` vector)
    offset: int  # where its slice of the accumulator starts
    acc: Optional[Tensor] = None  # 1-D fp32 view of the accumulator (None: the layout keeps no whole slice)
    full_view: Optional[Tensor] = None  # the accumulator slice shaped like the param
    # its slice of the masters' buffer (flat.master), as the masters' format keeps it
    # (fused_accum.masters: an fp32 copy, or the low halves under a bf16 parameter); None: none kept
    master: Optional[Tensor] = None
    state: dict = dataclasses.field(default_factory=dict)  # optimizer state name -> 1-D fp32 view
    # the parameter as a compiled step writes it (fused_accum.compiled): a bf16/fp16 one as a
    # detached alias of its storage, as Dynamo refuses a graph input whose .grad (the window's
    # fp32 view) has another dtype; an fp32 one as itself
    weight: Optional[Tensor] = None
    local: slice = dataclasses.field(
        default_factory=lambda: slice(0, 0)
    )  # where its master and state lie in the group's (local) buffers
    bucket_index: int = 0
    # --- the window's (written by fused_accum.ledger only) ---
    _grad_view: Optional[Tensor] = None  # (grad_view) what ``.grad`` is set to
    _has_grad: bool = False  # (has_grad) the accumulator slice holds this window's gradient
    _folded_in: int = -1  # (folded_in) the backward that last folded it (to spot a second piece)
    _stepped: bool = False  # (stepped) step_in_backward already applied its update this window
    # --- a layout's own (fused_accum.topology.zero): this rank's elements of the parameter ---
    piece: Optional[tuple] = None
    placeholder: Optional[Tensor] = None  # what .grad shows when no full gradient exists here
    # the counter of the window the slot is in (fused_accum.ledger); until then a shared one
    changes: array.array = dataclasses.field(default_factory=lambda: _UNCOUNTED)

    has_grad = _read_only("_has_grad")
    grad_view = _read_only("_grad_view")
    folded_in = _read_only("_folded_in")
    stepped = _read_only("_stepped")


@dataclasses.dataclass(eq=False)
class Bucket:
    """Slots folded by one accumulate call (and reduced by one collective)."""

    slots: list  # consecutive slots, in flat-buffer order
    start: int = 0  # the bucket's slots cover flat buffer elements [start, end), padding included
    end: int = 0
    offsets: Optional[Tensor] = None  # int64 on the CPU: each slot's offset, for accumulate


class Layout:
    """Where a flat group's slices lie: one process's layout, every parameter whole in every
    buffer. The points where another mode lays them out otherwise are its methods; each takes
    the flat group (layouts hold nothing of it)."""

    bucket_align = ALIGN  # each bucket's range is a multiple of this many elements

    def state_device(self, device: torch.device) -> torch.device:
        """Where the masters, the optimizer state and the step's scalars live: with the
        parameters (the host placement keeps them on the host: fused_accum.placement)."""
        return device

    def step_backend(self, backend: str) -> str:
        """The backend that steps (the host placement's CPU kernels); the folds use the group's own."""
        return backend

    def stored(self, param: Tensor) -> Tensor:
        """What this process stores and steps of ``param``: all of it."""
        return param

    def local_numel(self, total: int) -> int:
        """Elements of the master and state buffers, for ``total`` of the accumulator's layout."""
        return total

    def acc_numel(self, total: int) -> int:
        return total

    def place_buckets(self, flat: "FlatGroup") -> None:
        """After the buckets are made: anything of the layout's own about them."""

    def set_views(self, flat: "FlatGroup", slot: Slot) -> None:
        """Point ``slot``'s acc, full_view, grad_view, master and state at the buffers."""
        n = self.stored(slot.param).numel()
        slot.local = slice(slot.offset, slot.offset + n)
        slot.acc = flat.acc[slot.local]
        slot._grad_view = slot.full_view = slot.acc.view(self.stored(slot.param).shape)
        slot.weight = slot.param.detach() if slot.param.dtype in LOW_PRECISION else slot.param
        flat.masters.set_views(flat, slot)
        slot.state = {key: buf[slot.local] for key, buf in flat.state.items()}

    def param_piece(self, flat: "FlatGroup", slot: Slot) -> Tensor:
        """The elements of ``slot``'s parameter (flattened, detached) whose master and state
        this process holds."""
        return self.stored(slot.param.detach()).reshape(-1)

    def write_param_piece(self, flat: "FlatGroup", slot: Slot, values: Tensor) -> None:
        """Write ``values`` (1-D, the parameter's dtype) over param_piece's elements."""
        stored = self.stored(slot.param.detach())
        stored.copy_(values.view(stored.shape))

    def step_lists(self, flat: "FlatGroup", active: list) -> tuple:
        """(slots, accs, weights) the step op takes for ``active`` slots (the weights' lists as
        the masters' format makes them of the parameters: fused_accum.masters.StepWeights),
        every one whole. Each param as it is (any strides: a channels_last weight cannot be viewed as 1-D);
        the backends walk it in logical order, the order of its accumulator slice. Passed as is,
        not detached (the step runs under no_grad, as torch's fused optimizers pass theirs): a
        detach per parameter per step costs a microsecond each."""
        return active, [s.acc for s in active], flat.masters.step_tensors(active, [s.param for s in active])

    def user_grad(self, flat: "FlatGroup", slot: Slot, grad: Tensor) -> Tensor:
        """A ``.grad`` the user assigned, as the slot's slice holds it."""
        return grad

    def loaded(self, flat: "FlatGroup", slot: Slot, value: Tensor) -> Tensor:
        """A saved or assigned per-parameter value (a checkpoint's state, an ``opt.state``
        entry) as the 1-D fp32 values of ``slot``'s master or state slice."""
        return value.detach().to(device=flat.device, dtype=torch.float32).reshape(-1)

    def state_view(self, flat: "FlatGroup", slot: Slot, buf: Tensor) -> Tensor:
        """``buf`` (a slot's master or state view) as ``opt.state`` shows it: shaped like the
        parameter (in-place edits go through)."""
        return buf.view(slot.param.shape)

    def saves_accum(self, slot: Slot) -> bool:
        """Whether a checkpoint holds the slot's window gradient (``accum``)."""
        return slot.grad_view is not None and slot.grad_view is not slot.placeholder


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
        states,
        master_weights,
        backend,
        bucket_numel,
        layout: Optional[Layout] = None,
    ):
        self.index, self.group_index = index, group_index
        self.dtype, self.device, self.backend = dtype, device, backend
        self.layout = layout = layout if layout is not None else Layout()
        self.step_backend = layout.step_backend(backend)
        self.plan = object()  # names this group's buffers to the Triton backend's plan cache (ops plan=)
        self.master_weights = master_weights
        self._first_name = names[0] if names else "?"  # (for errors about the whole group)
        self._set_master_mode(dtype)
        numels = [layout.stored(p).numel() for p in params]
        members = bucket_members(numels, bucket_numel)
        # Offsets in registration order; each bucket's end padded to the layout's alignment (a
        # no-op for one process: slices are already padded to ALIGN).
        offsets, total, ranges = [0] * len(params), 0, {}
        align = layout.bucket_align
        for b in reversed(range(len(members))):
            start = total
            for i in members[b]:
                offsets[i] = total
                total += -(-numels[i] // ALIGN) * ALIGN
            total = -(-total // align) * align
            ranges[b] = (start, total)
        self.total = total
        self.local_numel = layout.local_numel(total)
        self.acc = torch.zeros(layout.acc_numel(total), dtype=torch.float32, device=device)
        fp32 = dict(dtype=torch.float32, device=layout.state_device(device))
        self.master = self.masters.new_buffer(self.local_numel, fp32["device"])  # (the format's: or None)
        # the optimizer-state buffers: key -> its initial value
        self.state = {key: torch.full((self.local_numel,), initial, **fp32) for key, initial in states.items()}
        self.steps = torch.zeros(len(params), **fp32)  # per-parameter step counts
        # float64, as torch's fused optimizers take lr: a Python float lr keeps every bit
        self.lr = torch.zeros((), dtype=torch.float64, device=fp32["device"])
        self.coef = torch.ones((), **fp32)
        self.one = torch.ones((), **fp32)
        self._index_cache: dict = {}  # active slot indices -> device index tensor (see active_index)
        self.slots = [
            Slot(p, name, first_key + i, index, i, off) for i, (p, name, off) in enumerate(zip(params, names, offsets))
        ]
        self.buckets = []
        for b, indices in enumerate(members):
            bucket = Bucket([self.slots[i] for i in indices], *ranges[b])
            bucket.offsets = torch.tensor([offsets[i] for i in indices], dtype=torch.int64)
            for slot in bucket.slots:
                slot.bucket_index = b
            self.buckets.append(bucket)
        layout.place_buckets(self)
        self._make_views()

    def _make_views(self) -> None:
        """Every slot's views of the buffers (the layout's), and its master from its parameter."""
        for slot in self.slots:
            self.layout.set_views(self, slot)
            self.masters.initialise(self, slot)
        # the slots whose weight is an alias (stale_weights)
        self._aliased = [s for s in self.slots if s.weight is not None and s.weight is not s.param]
        self._mark_static()

    def _mark_static(self) -> None:
        """The buffers (and weight aliases) marked as static inputs of compiled graphs
        (fused_accum.compiled): their addresses do not change, so a CUDA graph writes them in
        place instead of copying each in and out around its replay (torch.optim's compiled step
        marks its state so). One replaced later (a move) is recorded again by the CUDA graphs
        (mark_static_address's unguarded kind)."""
        for t in (self.acc, self.master, self.steps, self.lr, self.coef, self.one, *self.state.values()):
            if t is not None:
                torch._dynamo.mark_static_address(t)
        for slot in self._aliased:
            torch._dynamo.mark_static_address(slot.weight)

    def _set_master_mode(self, dtype) -> None:
        label = f"{self._first_name} (and its group's others on {self.device})"
        self.masters = masters.choose(self.master_weights, dtype, label)  # what the master is

    # --- the fp32 master, whatever its format (fused_accum.masters) ---

    def master_of(self, slot: Slot) -> Tensor:
        """``slot``'s fp32 master as this process holds it (1-D)."""
        return self.masters.master_of(self, slot)

    def set_master(self, slot: Slot, value: Optional[Tensor]) -> None:
        """``slot``'s master becomes ``value`` (1-D fp32, a checkpoint's), or the parameter's
        value exactly (None)."""
        self.masters.set_master(self, slot, value)

    def master_buffer(self) -> Optional[Tensor]:
        """The local fp32 masters as one buffer (the master buffer's layout), or None where
        the group keeps none."""
        return self.masters.fp32_buffer(self)

    # --- what the layout decides (the flat group's callers ask here) ---

    def param_piece(self, slot: Slot) -> Tensor:
        return self.layout.param_piece(self, slot)

    def step_lists(self, active: list) -> tuple:
        return self.layout.step_lists(self, active)

    def user_grad(self, slot: Slot, grad: Tensor) -> Tensor:
        return self.layout.user_grad(self, slot, grad)

    def graph_lists(self, active: list, aliased: bool) -> tuple:
        """(accs, weights, states): ``step_lists``' and the slots' state views, as a compiled
        step traces them (fused_accum.compiled, one process's layout): each slice taken from
        its buffer inside the graph (a view passed in is an input of its own, which the graph
        copies in and back out around the op), and the parameters, or where ``aliased`` their
        slots' ``weight`` aliases."""
        accs = [self.acc[s.local] for s in active]
        masters = [self.master[s.local] for s in active] if self.master is not None else None
        weights = self.masters.step_tensors(active, [s.weight if aliased else s.param for s in active], masters)
        return accs, weights, [{key: buf[s.local] for key, buf in self.state.items()} for s in active]

    def loaded(self, slot: Slot, value: Tensor) -> Tensor:
        return self.layout.loaded(self, slot, value)

    def state_view(self, slot: Slot, buf: Tensor) -> Tensor:
        return self.layout.state_view(self, slot, buf)

    def new_grad_view(self, slot: Slot) -> Tensor:
        """A new ``.grad`` view of ``slot``'s accumulator slice (the old one was re-pointed
        elsewhere through ``.data``); the window's ledger sets it."""
        slot.full_view = slot.acc.view(slot.full_view.shape)
        return slot.full_view

    # --- the group's life ---

    def rehome(self, device, backend) -> None:
        """The parameters moved or were cast (``model.to(device)``, ``model.to(torch.bfloat16)``,
        or ``to_empty`` after building on the meta device): move the buffers after them. State
        and step counts move as they are (zeros when they were on the meta device); masters are
        copied from the parameters (a cast to bf16/fp16 gains one, a cast to fp32 drops it). No
        gradient survives: the caller tells the window's ledger."""

        state_device = self.layout.state_device(device)

        def move(t):
            return torch.zeros_like(t, device=state_device) if t.is_meta else t.to(state_device)

        self.device, self.backend = device, backend
        self.step_backend = self.layout.step_backend(backend)
        self.dtype = self.slots[0].param.dtype
        self._set_master_mode(self.dtype)
        self.acc = torch.zeros_like(self.acc, device=device)
        self.state = {key: move(buf) for key, buf in self.state.items()}
        self.steps, self.lr, self.coef, self.one = (move(t) for t in (self.steps, self.lr, self.coef, self.one))
        self.master = self.masters.new_buffer(self.local_numel, state_device)
        self._index_cache = {}
        self.plan = object()  # new buffers: a new launch plan
        self._make_views()

    def stale_weights(self) -> list:
        """Slots whose ``weight`` alias no longer shares its parameter's storage (``p.data = t``
        replaced it): a compiled step traced over the alias would write the old storage."""
        aliased = self._aliased
        weights, params = map(_WEIGHT, aliased), map(_PARAM, aliased)
        if list(map(Tensor.data_ptr, weights)) == list(map(Tensor.data_ptr, params)):  # (C-level)
            return []
        return [s for s in aliased if s.weight.data_ptr() != s.param.data_ptr()]

    def refresh_weights(self) -> None:
        for slot in self.stale_weights():
            slot.weight = slot.param.detach()
        self._mark_static()

    def refresh_masters(self) -> None:
        """The masters follow the weights written from outside, by value, for what reads them
        outside a step (checkpoints, a torch.optim class stepping them): the format decides
        what a written weight means (fused_accum.masters)."""
        self.masters.follow(self)

    def ensure_state(self, key: str, initial: float = 0.0) -> bool:
        """Allocate an optimizer state buffer first needed after construction (momentum turned
        on, amsgrad enabled by editing a param group), at ``initial``; True when it was
        allocated now."""
        if key in self.state:
            return False
        buf = self.state[key] = torch.full((self.local_numel,), initial, dtype=torch.float32, device=self.steps.device)
        torch._dynamo.mark_static_address(buf)  # (see _mark_static)
        for slot in self.slots:  # (only the state views: .grad keeps showing the same tensor)
            slot.state[key] = buf[slot.local]
        return True

    def active_index(self, indices: tuple) -> Tensor:
        """A device tensor of slot ``indices`` (a partial active set), made once per distinct
        set: no host-to-device copy inside later steps (and none under CUDA-graph capture).
        Traced by torch.compile, a constant of the graph (the cache is Python state: a graph
        guarded on it would retrace as it changes)."""
        if torch.compiler.is_compiling():
            return torch.tensor(indices, dtype=torch.int64, device=self.steps.device)
        cache = self._index_cache
        index = cache.pop(indices, None)
        if index is None:
            index = torch.tensor(indices, dtype=torch.int64, device=self.steps.device)
            if len(cache) >= ACTIVE_SETS_KEPT:  # (MoE routing: a new set most steps)
                del cache[next(iter(cache))]  # the least recently used
        cache[indices] = index  # (most recent last)
        return index

    def nbytes(self) -> int:
        """Bytes held by this group's buffers (accumulator, masters, state, steps)."""
        buffers = [self.acc, self.steps] + list(self.state.values())
        buffers += [self.master] if self.master is not None else []
        return sum(b.numel() * b.element_size() for b in buffers)

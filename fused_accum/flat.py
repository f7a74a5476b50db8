"""The flat fp32 buffers: where each parameter's accumulator, master copy and optimizer state live.

One :class:`FlatGroup` per (param group, device, param dtype) holds one fp32 buffer per role
(the gradient accumulator, the fp32 master of low-precision params, each optimizer state such
as ``exp_avg``) and a per-parameter step count. Each parameter owns a :class:`Slot`: an aligned
slice of every buffer. Buckets are runs of consecutive slots, so each is one contiguous range of
the buffer: the unit one accumulate call folds and one collective reduces.

This layer knows nothing of hooks, windows or algorithms. It holds no reference cycles (slots
name their flat group and bucket by index), so an optimizer's buffers are freed the moment the
optimizer is, without waiting for the cyclic garbage collector.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

ALIGN = 64  # elements: each slice starts 256 bytes into an fp32 buffer (16-byte vector loads, and 128-byte lines)
LOW_PRECISION = (torch.bfloat16, torch.float16)
SUPPORTED_DTYPES = (torch.float32,) + LOW_PRECISION


def padded_offsets(numels) -> tuple[list[int], int]:
    """Where each of ``numels`` starts in a flat buffer whose slices are padded to ``ALIGN``,
    and the buffer's total size."""
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


@dataclasses.dataclass(eq=False)
class Slot:
    """One parameter's place in its flat group, and its state in the current window."""

    param: Tensor
    name: str
    key: int  # position in the optimizer's list of all slots (what its hooks carry)
    flat_index: int  # which FlatGroup (position in the optimizer's list)
    index: int  # position in the flat group (and in its ``steps`` vector)
    offset: int  # where its slice of the flat buffers starts
    acc: Tensor  # 1-D fp32 view of the accumulator
    grad_view: Tensor  # the same memory shaped like the param: what ``.grad`` is set to
    master: Optional[Tensor]  # 1-D fp32 master copy, for low-precision params with master weights
    state: dict  # optimizer state name -> 1-D fp32 view
    bucket_index: int = 0
    # --- the window (owned by fused_accum.window) ---
    has_grad: bool = False  # the accumulator slice holds this window's gradient
    in_stats: bool = False  # its final value is already in the window's norm / non-finite flag
    folded_in: int = -1  # the micro-batch in which it was last folded (to spot a second piece)
    stepped: bool = False  # step_in_backward already applied its update this window


@dataclasses.dataclass(eq=False)
class Bucket:
    """Slots folded by one accumulate call; arrivals wait here until the bucket is complete."""

    slots: list  # consecutive slots, in flat-buffer order
    start: int = 0  # the bucket's slots cover flat buffer elements [start, end), padding included
    end: int = 0
    offsets: Optional[Tensor] = None  # int64 on the CPU: each slot's offset, for accumulate
    # slot key -> its gradient so far in this backward (a parameter used both inside a
    # reentrant checkpoint and outside it receives two gradients in one backward: summed here)
    arrived: dict = dataclasses.field(default_factory=dict)
    # slot keys whose gradient this backward was written straight into the accumulator
    # (fused weight-gradient GEMM): they count as arrived but have nothing to fold
    in_place: set = dataclasses.field(default_factory=set)


class FlatGroup:
    """The flat fp32 buffers of the parameters of one param group, one device and one dtype."""

    def __init__(self, index, group_index, params, names, first_key, dtype, device, state_keys,
                 master_weights, backend, bucket_numel):  # fmt: skip
        self.index, self.group_index = index, group_index
        self.dtype, self.device, self.backend = dtype, device, backend
        self.has_master = dtype in LOW_PRECISION and master_weights
        offsets, total = padded_offsets(p.numel() for p in params)
        fp32 = dict(dtype=torch.float32, device=device)
        self.acc = torch.zeros(total, **fp32)
        self.master = torch.zeros(total, **fp32) if self.has_master else None
        self.state = {key: torch.zeros(total, **fp32) for key in state_keys}
        self.steps = torch.zeros(len(params), **fp32)  # per-parameter step counts
        self.lr = torch.zeros((), **fp32)
        self.coef = torch.ones((), **fp32)
        self.one = torch.ones((), **fp32)
        self._index_cache: dict = {}  # active slot indices -> device index tensor (see active_index)
        self.slots = []
        for i, (p, name, off) in enumerate(zip(params, names, offsets)):
            self.slots.append(Slot(p, name, first_key + i, index, i, off, *self._views(p, off)))
            if self.has_master:
                self.slots[-1].master.copy_(p.detach().reshape(-1))
        self.buckets = self._make_buckets(offsets, total, bucket_numel)

    def _views(self, p, off) -> tuple:
        """(acc, grad_view, master, state) of the parameter ``p`` whose slice starts at ``off``."""
        window = slice(off, off + p.numel())
        acc = self.acc[window]
        master = self.master[window] if self.has_master else None
        return acc, acc.view(p.shape), master, {key: buf[window] for key, buf in self.state.items()}

    def rehome(self, device, backend) -> None:
        """The parameters moved (``model.to(device)``, or ``to_empty`` after building on the
        meta device): move the buffers after them. State and step counts move as they are
        (zeros when they were on the meta device); masters are copied from the parameters."""
        def move(t):
            return torch.zeros_like(t, device=device) if t.is_meta else t.to(device)

        self.device, self.backend = device, backend
        self.acc = torch.zeros_like(self.acc, device=device)  # no gradient survives a move
        self.state = {key: move(buf) for key, buf in self.state.items()}
        self.steps, self.lr, self.coef, self.one = (move(t) for t in (self.steps, self.lr, self.coef, self.one))
        if self.master is not None:
            self.master = torch.zeros_like(self.master, device=device)
        self._index_cache = {}
        for slot in self.slots:
            slot.acc, slot.grad_view, slot.master, slot.state = self._views(slot.param, slot.offset)
            if slot.master is not None:
                slot.master.copy_(slot.param.detach().reshape(-1))
            slot.has_grad = slot.in_stats = False

    def _make_buckets(self, offsets, total, bucket_numel) -> list:
        # Buckets follow reverse registration order, the order backward usually produces grads.
        buckets, current, size = [], [], 0
        for slot in reversed(self.slots):
            current.append(slot)
            size += slot.param.numel()
            if size >= bucket_numel:
                buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(Bucket(current))
        ends = offsets[1:] + [total]  # a slice's padded end is where the next one starts
        for b, bucket in enumerate(buckets):  # consecutive slots: one contiguous range of the buffer
            bucket.slots.reverse()
            bucket.start = bucket.slots[0].offset
            bucket.end = ends[bucket.slots[-1].index]
            bucket.offsets = torch.tensor([s.offset for s in bucket.slots], dtype=torch.int64)
            for slot in bucket.slots:
                slot.bucket_index = b
        return buckets

    def step_targets(self, slot: Slot):
        """(tensor the step updates, low-precision tensor to write or None) for ``slot``."""
        # The param as it is (any strides: a channels_last weight cannot be viewed as 1-D); the
        # backends walk it in logical order, the order of its accumulator slice.
        param = slot.param.detach()
        if self.has_master:
            return slot.master, param
        return param, None

    def ensure_state(self, key: str) -> None:
        """Allocate an optimizer state buffer first needed after construction (momentum turned
        on, amsgrad enabled by editing a param group)."""
        if key not in self.state:
            buf = torch.zeros_like(self.acc)
            self.state[key] = buf
            for slot in self.slots:
                slot.state[key] = buf[slot.offset : slot.offset + slot.param.numel()]

    def active_index(self, indices: tuple) -> Tensor:
        """A device tensor of slot ``indices`` (a partial active set), made once per distinct
        set: no host-to-device copy inside later steps (and none under CUDA-graph capture)."""
        index = self._index_cache.get(indices)
        if index is None:
            index = torch.tensor(indices, dtype=torch.int64, device=self.device)
            self._index_cache[indices] = index
        return index

    def nbytes(self) -> int:
        """Bytes of fp32 held by this group's buffers (accumulator, master, state, steps)."""
        buffers = [self.acc, self.steps] + list(self.state.values())
        if self.master is not None:
            buffers.append(self.master)
        return sum(b.numel() * b.element_size() for b in buffers)

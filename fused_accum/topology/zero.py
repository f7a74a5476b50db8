"""``shard="state"`` and ``shard="grads"`` (ZeRO-1 and ZeRO-2 over ``process_group``): each rank
owns one part of every bucket's masters and state (and, with "grads", of its accumulator).

With ``"state"`` the accumulator is whole, so ``.grad`` shows the local fp32 running sum until
the window's reduction; the reduction (a reduce-scatter per bucket) leaves the group's gradient
only in this rank's part of each bucket, so from then until the step ``.grad`` is a
:class:`ShardedGrad` placeholder whose every use raises an error pointing to
``max_grad_norm``; after the step ``.grad`` is None. With ``"grads"`` there is never a full
gradient: each backward's gradients are folded into a staging buffer per bucket, reduce-scattered
at the backward's end and added into this rank's part; ``.grad`` is the placeholder throughout.
The step updates this rank's parts and all-gathers the parameters.

Its layout (:class:`ShardedLayout`): every bucket's range is padded to a multiple of ``ALIGN *
world`` and split into ``world`` equal contiguous parts; this rank owns one part of each bucket
(one ``reduce_scatter``/``all_gather`` per bucket, the bucket being the collective's unit). The
master and optimizer-state buffers then hold only the owned parts, concatenated in buffer order
(``local_numel = total / world`` elements), and each slot's ``piece`` says which elements of its
parameter fall in them (a parameter split across ranks gets a partial piece, one that lies
elsewhere gets none). ``shard="grads"`` shards the accumulator the same way.

``reduce_dtype="exact"`` (``"grads"`` only; :class:`fused_accum.distributed.WindowReducer`): the
gradients go on the wire in their own dtype by an all-to-all and are folded in rank order, the
accumulators keep the group's sum (``step_divisor``: the step divides by N), buckets are padded
to ``CHUNK x world`` so that every part is whole chunks of the world-size invariant norm
(:func:`fused_accum.topology.base.chunk_sums`), gathered in the one-process chunk order
(:meth:`ShardedLayout.chunk_order`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from ..distributed import is_dtensor, local_tensor
from ..flat import ALIGN, Layout
from .base import CHUNK, buffer_order, chunk_sums, content, tree_sum
from .replicated import Replicated


class ShardedGrad(Tensor):
    """What ``.grad`` shows in a sharded mode when no full gradient exists: a tensor of the
    parameter's shape, fp32, without storage, whose every operation raises a clear error.
    (``None`` would make ``clip_grad_norm_`` silently clip nothing.)"""

    @staticmethod
    def __new__(cls, param: Tensor, mode: str):
        grad = Tensor._make_wrapper_subclass(cls, param.shape, dtype=torch.float32, device=param.device)
        grad._mode = mode
        return grad

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # (GradScaler passes them in a list: look through nested arguments)
        leaves = tree_leaves((args, kwargs))
        mode = next((a._mode for a in leaves if isinstance(a, ShardedGrad)), "state")
        raise RuntimeError(
            f"fused_accum (shard={mode!r}): this .grad holds no gradient: the window's gradient is "
            "reduce-scattered, each rank holding only its shard, so it cannot be read, clipped or "
            f"unscaled ({func}). Pass max_grad_norm= (and skip_nonfinite=) to the optimizer instead "
            "of calling clip_grad_norm_ (the global norm is then in opt.last_grad_norm); "
            "use shard=None to read .grad."
        )

    def __repr__(self):
        return f"ShardedGrad(shape={tuple(self.shape)}, shard={self._mode!r}: no full gradient on this rank)"


def _storage_shared(param: Tensor) -> bool:
    """Whether a tensor other than ``param`` holds its storage (an alias: ``param.data`` or
    ``param.detach()`` kept, a state_dict's entry, another Parameter made over it). The storage's
    reference count: ``param``'s own and the Python storage object asked for it make 2."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # (a torch without it: never move memory that may be seen)
        return True
    return count(param.untyped_storage()._cdata) > 2


class ShardedLayout(Layout):
    """One rank's part of every bucket (see the module): the layout of ``shard=``'s flat groups.
    One per flat group: it keeps each bucket's part, and the step's staging buffer."""

    def __init__(self, rank: int, world: int, mode: str, exact: bool = False) -> None:
        self.rank, self.world, self.mode = rank, world, mode
        self.grads = mode == "grads"  # the accumulator is sharded too
        # reduce_dtype="exact": every part is whole chunks of the world-size invariant norm
        self.bucket_align = (CHUNK if exact else ALIGN) * world
        self._chunk_order: Optional[Tensor] = None  # (exact) see chunk_order
        self.parts: list = []  # by bucket: (start, end) of this rank's part, where it lies locally
        self.staging: Optional[Tensor] = None  # the params' all-gather buffer during a step
        # The parameters' storage (see bind): one buffer in the accumulator's layout, in their
        # dtype, each parameter a view of its slice; the step writes this rank's pieces and the
        # all-gathers the others' in place. None until the first slot's views are made.
        self.params: Optional[Tensor] = None
        self.bound: list = []  # by slot index: the data_ptr of a bound parameter, None if loose
        self.pieces: list = []  # by slot index: (reduced gradient piece, staged piece) 1-D views, or None
        self._full_lists: Optional[tuple] = None  # step_lists of every slot, while the views hold

    def local_numel(self, total: int) -> int:
        return total // self.world

    def acc_numel(self, total: int) -> int:
        return total // self.world if self.grads else total

    def place_buckets(self, flat) -> None:
        self.parts = [None] * len(flat.buckets)
        local_start = 0
        for b in reversed(range(len(flat.buckets))):  # buffer order
            bucket = flat.buckets[b]
            part = (bucket.end - bucket.start) // self.world
            start = bucket.start + self.rank * part
            self.parts[b] = (start, start + part, local_start)
            local_start += part

    def part(self, flat, bucket_index: int) -> tuple:
        """(start, end, local start) of this rank's part of a bucket."""
        return self.parts[bucket_index]

    def set_views(self, flat, slot) -> None:
        p, off = slot.param, slot.offset
        start, end, local_start = self.parts[slot.bucket_index]
        first, last = max(off, start), min(off + p.numel(), end)
        if first < last:
            local = local_start + first - start
            slot.piece = (first - off, last - off, local)
            slot.local = slice(local, local + last - first)
        else:
            slot.piece, slot.local = None, slice(0, 0)
        if self.grads:  # no full accumulator: the piece of the sharded one
            slot.acc = slot._grad_view = slot.full_view = None
        else:
            slot.acc = flat.acc[off : off + p.numel()]
            slot._grad_view = slot.full_view = slot.acc.view(p.shape)
        flat.masters.set_views(flat, slot)
        slot.state = {key: buf[slot.local] for key, buf in flat.state.items()}
        params = self.params
        if params is None or (params.device, params.dtype) != (flat.device, flat.dtype):
            self.params = torch.zeros(flat.total, dtype=flat.dtype, device=flat.device)  # (padding stays 0)
            self.bound, self.pieces = [None] * len(flat.slots), [None] * len(flat.slots)
        self._full_lists = None
        self.bind(flat, slot)
        if slot.piece is not None:
            first, end, local = slot.piece
            acc = flat.acc[local : local + end - first] if self.grads else slot.acc[first:end]
            self.pieces[slot.index] = (acc, self.params[slot.offset + first : slot.offset + end])
        else:
            self.pieces[slot.index] = None

    def bind(self, flat, slot) -> None:
        """Make ``slot``'s parameter a view of its slice of :attr:`params` (its values copied
        there first), as torch's ZeroRedundancyOptimizer does with
        ``parameters_as_bucket_view=True``: the step then updates this rank's pieces in place
        and the all-gathers write every rank's straight into the parameters, with no copy in or
        out per parameter (O(buckets) ops per step, not O(parameters)). The parameter object,
        its autograd node and hooks stay (``.data`` of the same dtype and device).

        Only memory nothing else sees moves: a parameter stays loose (its piece copied in and
        out at each step, two copies per parameter) where its storage is held by another tensor
        too (a ``model.state_dict()`` or a ``.data`` taken before, a second Parameter over it:
        moved, they would silently stop following the weights), where it does not own its
        whole storage (a view of another tensor, a tied slice) or is not contiguous
        (channels_last: its memory order is not its elements' order). :meth:`begin_step` asks
        again at each step for the loose ones (bound once the other holder is gone) and for
        a parameter whose ``.data`` was replaced since."""
        p = slot.param
        n = p.numel()
        view = self.params[slot.offset : slot.offset + n]
        fits = p.is_contiguous() and (p.device, p.dtype) == (view.device, view.dtype)
        if fits and p.data_ptr() == view.data_ptr() and not p.is_meta:
            self.bound[slot.index] = p.data_ptr()  # (bound already)
            return
        whole = p.untyped_storage().nbytes() == n * p.element_size() and p.storage_offset() == 0
        if not (fits and whole) or _storage_shared(p):
            self.bound[slot.index] = None
            return
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(p.shape)
        self.bound[slot.index] = p.data_ptr()

    def param_piece(self, flat, slot) -> Tensor:
        whole = slot.param.detach().reshape(-1)
        return whole[slot.piece[0] : slot.piece[1]] if slot.piece is not None else whole[:0]

    def write_param_piece(self, flat, slot, values: Tensor) -> None:
        if slot.piece is not None:  # (the other ranks write theirs; the next step gathers all)
            slot.param.detach().view(-1)[slot.piece[0] : slot.piece[1]].copy_(values)

    def step_lists(self, flat, active: list) -> tuple:
        """The active slots holding a piece here, with 1-D views of that piece: the reduced
        gradient, and as targets the fp32 master piece (lp target: the piece of the staging
        buffer) or, without an fp32 master, the staging piece itself (with its remainder in the
        remainder mode). Between begin_step and finish_step. The views were made with the
        slots' (set_views): no op here, and the lists of a step of every slot are kept."""
        everyone = len(active) == len(flat.slots)
        if everyone and self._full_lists is not None:
            return self._full_lists
        held = [s for s in active if s.piece is not None]
        pieces = [self.pieces[s.index] for s in held]
        accs = [acc for acc, _ in pieces]
        staged = [piece for _, piece in pieces]
        lists = held, accs, flat.masters.step_tensors(held, staged)
        if everyone:
            self._full_lists = lists
        return lists

    def begin_step(self, flat) -> None:
        """Stage the parameters for the step to update this rank's pieces in place and the
        all-gathers to spread (a skipped step leaves them as they were): the bound parameters
        are the staging buffer already; a loose one's piece is copied in (:meth:`bind`). A
        parameter whose ``.data`` was replaced since it was bound is bound again (one C-level
        pass over the parameters' data pointers; nothing else when none was)."""
        self.staging = self.params
        now = list(map(Tensor.data_ptr, (s.param for s in flat.slots)))
        if now == self.bound:
            return
        loose = []
        for slot, ptr, was in zip(flat.slots, now, self.bound):
            if ptr != was:
                self.bind(flat, slot)
            if self.bound[slot.index] is None and slot.piece is not None:
                loose.append(slot)
        if loose:
            torch._foreach_copy_(
                [self.pieces[s.index][1] for s in loose],
                [s.param.detach().reshape(-1)[s.piece[0] : s.piece[1]] for s in loose],
            )

    def gather_ranges(self, flat) -> list:
        """(whole bucket, this rank's part) views of the staging buffer, one per bucket, in the
        fixed bucket order: the all-gathers that spread the updated parameters."""
        return [(self.staging[b.start : b.end], self.staging[s:e]) for b, (s, e, _) in zip(flat.buckets, self.parts)]

    def finish_step(self, flat) -> None:
        """After the all-gathers: the bound parameters hold them already; copy the loose ones'
        (every one, from a staging buffer of offload's own)."""
        if self.staging is None:
            return
        staging, self.staging = self.staging, None
        if staging is self.params:
            slots = [s for s, ptr in zip(flat.slots, self.bound) if ptr is None]
        else:
            slots = flat.slots
        if slots:
            torch._foreach_copy_(
                [s.param.detach() for s in slots],
                [staging[s.offset : s.offset + s.param.numel()].view(s.param.shape) for s in slots],
            )

    def chunk_order(self, flat) -> Tensor:
        """reduce_dtype="exact": where, in the all-gathered [world, local chunks] chunk sums
        (flattened), each chunk of the buckets' content lies, in buffer order (the one-process
        chunk order: fused_accum.topology.base; a bucket's padding chunks are left out)."""
        if self._chunk_order is None:
            per_rank = flat.acc.numel() // CHUNK
            index = []
            for b in buffer_order(flat):
                bucket, (start, end, local_start) = flat.buckets[b], self.parts[b]
                per_part = (end - start) // CHUNK
                for j in range(-(-content(bucket) // CHUNK)):
                    rank, i = divmod(j, per_part)
                    index.append(rank * per_rank + local_start // CHUNK + i)
            self._chunk_order = torch.tensor(index, dtype=torch.int64, device=flat.device)
        return self._chunk_order

    def reduced_parts(self, flat) -> list:
        """1-D views of the reduced gradient this rank owns (one per bucket), what its share of
        the window's norm and non-finite flag is computed from."""
        if self.grads:
            return [flat.acc]
        return [flat.acc[s:e] for s, e, _ in self.parts]

    def piece_lengths(self, flat, slot) -> list:
        """How many elements of ``slot``'s parameter each rank's piece holds (by rank)."""
        bucket, n = flat.buckets[slot.bucket_index], slot.param.numel()
        part = (bucket.end - bucket.start) // self.world
        starts = [bucket.start + r * part for r in range(self.world)]
        return [max(0, min(slot.offset + n, s + part) - max(slot.offset, s)) for s in starts]

    def loaded(self, flat, slot, value: Tensor) -> Tensor:
        """A whole parameter's worth (torch's shape, e.g. from ``gathered_state_dict`` or an
        unsharded optimizer) is cut to this rank's piece; a piece's worth (this rank's own
        ``state_dict``) is taken as is; a DTensor of rows (``saved_value``) gives this rank's."""
        if is_dtensor(value):
            value = local_tensor(value).reshape(-1)[: self.piece_lengths(flat, slot)[self.rank]]
        value = super().loaded(flat, slot, value)
        if value.numel() != slot.param.numel():
            return value
        return value[slot.piece[0] : slot.piece[1]] if slot.piece is not None else value[:0]

    def state_view(self, flat, slot, buf: Tensor) -> Tensor:
        return buf  # the 1-D piece this rank holds (possibly empty)


class Zero(Replicated):
    sharded = True

    def __init__(self, process_group, shard: str, reduce_dtype=None) -> None:
        super().__init__(process_group, shard, reduce_dtype)
        self.name = f"zero ({shard})"
        self.mode = shard
        self.grads = shard == "grads"
        # reduce_dtype="exact" (see fused_accum.distributed): the accumulators hold the group's
        # sum; the step divides it by the world size unless num_items is given (whose count is
        # then summed, not averaged: WindowReducer.average_)
        self.exact = self.reducer.exact
        self.step_divisor = self.reducer.world if self.exact else 1
        if self.exact:
            self.name = "zero (grads, exact wire)"
        self._reduced = False  # "state": this window was reduce-scattered (no full .grad)
        # "state": flat groups that joined the window once it was reduce-scattered (parameters
        # unfrozen in it, whose first window's gradient is reduced on its own at the step)
        self._late: list = []
        self._user_staged = False  # "grads": a user-assigned .grad staged, not yet scattered
        self._raised = False  # "state": the reduction was ended by a backward that raised

    def layout(self) -> ShardedLayout:
        return ShardedLayout(self.reducer.rank, self.reducer.world, self.mode, self.exact)

    def _reduced_error(self, ledger):
        if self._raised:
            raise RuntimeError(
                f"{ledger.label}: a backward raised after this window's reduce-scatter had begun "
                "(shard='state' reduces once per window): the window was reduced with the "
                "gradients that had arrived, and no backward can add to it; call step() to step "
                "it, or zero_grad() to discard it, before the next backward"
            )
        raise RuntimeError(
            f"{ledger.label}: shard='state' reduces once per window and this window was "
            "already reduce-scattered; call step() (and zero_grad()) before the next "
            "backward, or run all but the window's last backward under opt.no_sync() "
            "or with accum_steps set"
        )

    def add(self, ledger, flat) -> None:
        for slot in flat.slots:
            slot.placeholder = ShardedGrad(slot.param, self.mode)
            if self.grads:
                ledger.view_set(slot, slot.placeholder)  # there is never a full gradient
        if self._reduced:
            self._late.append(flat)

    def before_backward(self, ledger) -> None:
        if self._reduced:
            self._reduced_error(ledger)

    def syncs(self, ledger) -> bool:
        # "grads" reduce-scatters every backward; the step averages
        return not self.grads and super().syncs(ledger)

    def final_at_bucket(self, ledger) -> bool:
        return False  # reduced at the window's end ("state") or the backward's ("grads")

    def stage(self, flat, bucket, slots: list, grads: list, plan) -> bool:
        if not self.grads:
            return False
        self.reducer.stage(flat, bucket, slots, grads, plan)  # (reduce-scattered after the backward)
        return True

    def in_place_ok(self, ledger, flat) -> bool:
        if self.grads:
            return False  # no full accumulator slice to write into
        if self._reduced:
            self._reduced_error(ledger)
        return True

    def bucket_complete(self, flat_groups, ledger, flat, bucket) -> None:
        if self.grads:
            self.reducer.bucket_staged(flat_groups, bucket)
        else:
            super().bucket_complete(flat_groups, ledger, flat, bucket)

    def backward_ended(self, ledger, flat_groups) -> None:
        if self.grads:  # every bucket is reduce-scattered once per backward, in order
            self.reducer.scatter_backward(flat_groups)

    def backward_raised(self, ledger, flat_groups) -> None:
        """With shard="grads" the raised backward's reduce-scatters end as at a backward's end
        (every rank issues them, in order; what arrived stays in the window). With "state" as
        ``process_group=``'s, after which the window is reduced: a retried backward is refused
        (shard="state" reduces once per window), step() steps what arrived."""
        if not self.reducer.reducing:
            return
        if self.grads:
            self.reducer.scatter_backward(flat_groups)
        else:
            self._raised = True
            super().backward_raised(ledger, flat_groups)

    def finish(self, ledger, flat_groups) -> None:
        if self._user_staged:
            self._user_staged = False
            self.reducer.scatter_backward(flat_groups)
        if not self._unreduced:
            return
        if self._reduced:
            if not self._late:
                self._reduced_error(ledger)
            flat_groups, self._late = self._late, []  # (only theirs is unreduced)
        super().finish(ledger, flat_groups)
        if not self.grads:
            self._reduced = True  # only this rank's parts hold the group's gradient now
            ledger.needs_checks()  # (a backward before the step is an error)
            for flat in flat_groups:
                for slot in flat.slots:
                    ledger.view_set(slot, slot.placeholder)

    def take_user_grad(self, flat_groups, slot, grad: Tensor) -> bool:
        flat = flat_groups[slot.flat_index]
        if self._reduced and not any(late is flat for late in self._late):
            raise RuntimeError(
                f"parameter {slot.name}: a .grad assigned by the user cannot be taken by a "
                "sharded optimizer once its window is reduce-scattered"
            )
        if slot.acc is not None:
            return False  # "state": the window copies it into the whole accumulator
        # "grads": this rank's gradient, staged in its bucket and reduce-scattered with the rest
        # of the bucket when the step reduces (every rank must assign its .grad, as every rank
        # runs every backward); it replaces what the window held (as an assigned .grad does)
        self.dropped(flat_groups, slot)
        self.reducer.stage(flat, flat.buckets[slot.bucket_index], [slot], [grad.detach()])
        self._unreduced = self._user_staged = True
        return True

    def dropped(self, flat_groups, slot) -> None:
        """With shard="grads" this rank's piece of ``slot``'s gradient, in the sharded
        accumulator, becomes -0.0 (the additive identity: the next reduce-scatter adds to it
        as if it overwrote, bit for bit on the exact wire). Every rank must clear it, as every
        rank runs every backward: the piece holds the ranks' sum, from which one rank's part
        cannot be taken out. ("state": the slice is whole until the reduction; the next fold
        overwrites it.)"""
        if self.grads:
            piece = flat_groups[slot.flat_index].layout.pieces[slot.index]
            if piece is not None:
                piece[0].fill_(-0.0)

    def norm_terms(self, ledger, flat_groups, home) -> tuple:
        """The sum of squares of this rank's reduced parts, summed over the group with one
        all-reduce (the non-finite flag follows from a non-finite sum). With reduce_dtype="exact"
        the world-size invariant one (fused_accum.topology.base): this rank's chunk sums,
        all-gathered (4 B per CHUNK elements), put in the one-process chunk order and added by a
        halving tree, the same bits on every rank and at every world size."""
        if self.exact:
            total = torch.zeros((), dtype=torch.float32, device=home)
            for flat in flat_groups:
                sums = chunk_sums(flat.acc.view(-1, CHUNK))
                gathered = self.reducer.sum_chunks(flat, sums).view(-1)
                total.add_(tree_sum(gathered[flat.layout.chunk_order(flat)]).to(home))
            return total, torch.zeros_like(total)
        sumsq = torch.zeros((), dtype=torch.float32, device=home)  # (one device: the group's)
        for flat in flat_groups:
            parts = [part for part in flat.layout.reduced_parts(flat) if part.numel()]
            if parts:
                sumsq.add_(torch.stack(torch._foreach_norm(parts)).square().sum())
        both = torch.stack([torch.zeros_like(sumsq), sumsq])  # (found_inf, sumsq), as the ledger's
        self.reducer.sum_(both)
        return both[1], both[0]

    def after_step(self, ledger, flat_groups) -> None:
        """No full gradient survives the step, so the window ends with it (a backward before
        ``zero_grad()`` starts a new one) and ``.grad`` becomes None."""
        self._reduced, self._late, self._raised = False, [], False
        self.reducer.new_window()
        for flat in flat_groups:
            for slot in flat.slots:
                ledger.cleared(slot)
                if slot.param.grad is slot.placeholder:
                    slot.param.grad = None
                if not self.grads and slot.grad_view is not slot.full_view:
                    ledger.view_set(slot, slot.full_view)

    def before_flat_step(self, flat, active: list) -> None:
        if active:
            flat.layout.begin_step(flat)  # stage this rank's pieces of the params

    def after_step_params(self, flat_groups) -> None:
        self.reducer.gather_params(flat_groups)  # the updated params, to every rank

    # --- checkpoints (fused_accum.checkpoint) ---

    def saved_value(self, flat, slot, key: str, value: Tensor) -> Tensor:
        """Each rank's piece of a master or state as a row of a DTensor, so
        torch.distributed.checkpoint keeps them all (WindowReducer.state_rows)."""
        if key == "accum" or value.dim() != 1:
            return value
        return self.reducer.state_rows(flat, slot, value)

    def gather_full(self, flat, buf: Tensor) -> Tensor:
        return self.reducer.gather_full(flat, buf)

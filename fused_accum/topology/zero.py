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
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from . import replicated


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


class Zero(replicated.Replicated):
    sharded = True

    def __init__(self, process_group, shard: str, reduce_dtype=None) -> None:
        super().__init__(process_group, shard, reduce_dtype)
        self.name = f"zero ({shard})"
        self.grads = shard == "grads"
        self._reduced = False  # "state": this window was reduce-scattered (no full .grad)
        self._user_staged = False  # "grads": a user-assigned .grad staged, not yet scattered

    def reduced_error(self, window):
        raise RuntimeError(
            f"{window.label}: shard='state' reduces once per window and this window was "
            "already reduce-scattered; call step() (and zero_grad()) before the next "
            "backward, or run all but the window's last backward under opt.no_sync() "
            "or with accum_steps set"
        )

    def add(self, flat) -> None:
        for slot in flat.slots:
            slot.placeholder = ShardedGrad(slot.param, self.sharding.mode)
            if self.grads:
                slot.grad_view = slot.placeholder  # there is never a full gradient

    def before_backward(self, window) -> None:
        if self._reduced:
            self.reduced_error(window)

    def syncs(self, count) -> bool:
        # "grads" reduce-scatters every backward; the step averages
        return not self.grads and super().syncs(count)

    def staging_for(self, flat, bucket):
        return self.reducer.staging_for(flat, bucket) if self.grads else None

    def in_place_ok(self, window, flat) -> bool:
        if self.grads:
            return False  # no full accumulator slice to write into
        if self._reduced:
            self.reduced_error(window)
        return True

    def bucket_complete(self, flat_groups, count, flat, bucket) -> None:
        if self.grads:
            self.reducer.bucket_staged(flat_groups, bucket)
        else:
            super().bucket_complete(flat_groups, count, flat, bucket)

    def backward_ended(self, window) -> None:
        if self.grads:  # every bucket is reduce-scattered once per backward, in order
            self.reducer.scatter_backward(window.flat_groups)

    def finish(self, window) -> None:
        if self._user_staged:
            self._user_staged = False
            self.reducer.scatter_backward(window.flat_groups)
        if not self._unreduced:
            return
        if self._reduced:
            self.reduced_error(window)
        super().finish(window)
        if not self.grads:
            self._reduced = True  # only this rank's parts hold the group's gradient now
            window.check_next_backward()  # (a backward before the step is an error)
            for slot in window.slots:
                slot.grad_view = slot.placeholder

    def take_user_grad(self, flat_groups, slot, grad: Tensor) -> bool:
        if self._reduced:
            raise RuntimeError(
                f"parameter {slot.name}: a .grad assigned by the user cannot be taken by a "
                "sharded optimizer once its window is reduce-scattered"
            )
        if slot.acc is not None:
            return False  # "state": the window copies it into the whole accumulator
        # "grads": this rank's gradient, staged in its bucket and reduce-scattered with the rest
        # of the bucket when the step reduces (every rank must assign its .grad, as every rank
        # runs every backward)
        from .. import ops

        flat = flat_groups[slot.flat_index]
        bucket = flat.buckets[slot.bucket_index]
        staged = self.reducer.staging_for(flat, bucket)
        relative = torch.tensor([slot.offset - bucket.start], dtype=torch.int64)
        ops.accumulate(staged, relative, [grad.detach()], 1.0, False, None, None, flat.backend)
        self._unreduced = self._user_staged = True
        return True

    def stats(self, flat_groups, window_stats) -> dict:
        """The sum of squares of this rank's reduced parts, summed over the group with one
        all-reduce (the non-finite flag follows from a non-finite sum)."""
        stats = {}
        for flat in flat_groups:
            found_inf, sumsq = window_stats.tensors(flat.device)
            if flat.device not in stats:
                found_inf.zero_()
                sumsq.zero_()
                stats[flat.device] = (found_inf, sumsq)
            parts = [part for part in flat.shard_grads() if part.numel()]
            if parts:
                sumsq.add_(torch.stack(torch._foreach_norm(parts)).square().sum())
        for found_inf, sumsq in stats.values():
            both = torch.stack([found_inf, sumsq])
            self.reducer.sum_(both)
            found_inf.copy_(both[0])
            sumsq.copy_(both[1])
        return stats

    def after_step(self, window) -> None:
        """No full gradient survives the step, so the window ends with it (a backward before
        ``zero_grad()`` starts a new one) and ``.grad`` becomes None."""
        self._reduced = False
        self.reducer.new_window()
        for slot in window.slots:
            slot.has_grad = False
            if slot.param.grad is slot.placeholder:
                slot.param.grad = None
            if not self.grads:
                slot.grad_view = slot.full_view

    def before_flat_step(self, flat, active: list) -> None:
        if active:
            flat.begin_step()  # stage this rank's pieces of the params

    def after_step_params(self, flat_groups) -> None:
        self.reducer.gather_params(flat_groups)  # the updated params, to every rank

    # --- checkpoints (fused_accum.checkpoint) ---

    def state_rows(self, flat, slot, piece: Tensor) -> Tensor:
        return self.reducer.state_rows(flat, slot, piece)

    def gather_full(self, flat, buf: Tensor) -> Tensor:
        return self.reducer.gather_full(flat, buf)

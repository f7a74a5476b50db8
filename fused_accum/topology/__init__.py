"""Who owns a gradient between backward and the step: one object per data-parallel topology.

The window (:mod:`fused_accum.window`) folds gradients into the flat buffers the same way in
every topology; at a few fixed points it asks its topology what else happens:

=========================  ==================================================================
``attach(window, slot)``   a slot is hooked (FSDP2 adds a hook of its own)
``stands_aside``           another engine fills ``.grad`` (DDP, FSDP2): the hooks do nothing
``before_backward``        a backward starts (zero: none may follow the window's reduction)
``fast_folds``             the hooks may fold and run backwards without Python (nothing to
                           reduce after a fold)
``staging_for``            where a bucket's gradients are folded instead of the accumulator
                           (shard="grads": a buffer reduce-scattered after the backward)
``in_place_ok``            a gradient may be written straight into its slice (fused wgrad)
``added``                  gradients were folded (so a reduction is owed)
``bucket_complete``        a bucket's local values are final for this backward
``syncs``                  the backward now running ends with the reduction
``backward_ended``         a backward that reached the parameters ended
``finish``                 complete the reduction owed (the window's last backward, the step)
``take_user_grad``         a ``.grad`` the user assigned (zero-grads stages it)
``stats``                  the window's norm and non-finite flag, if the topology makes them
``after_step``/``reset``   the window ended (stepped, discarded)
=========================  ==================================================================

and the optimizer asks it at the step: ``average_`` (the window's item count across ranks),
``sum_stats`` (FSDP2: the norm of local shards, over the mesh), ``after_step_params``
(sharded: gather the updated parameters), ``sharded`` and ``reducer`` (sharded checkpoints).
The choice is made once: at construction (:func:`choose`), except that :class:`Local` becomes
:class:`~.fsdp.FSDP2` when DTensor parameters join (:meth:`Local.join`), or
:class:`~.native.Native` at the first backward if a DDP wrapper was built after the optimizer
(:meth:`Local.resolve`).

``Local`` (one process, the default) does nothing at any point; each other topology lives in its
own module: :mod:`.native` (DDP owns ``.grad``), :mod:`.replicated` (``process_group=``),
:mod:`.zero` (``shard="state"``/``"grads"``), :mod:`.fsdp` (FSDP2's DTensor parameters).
"""

from __future__ import annotations

import contextlib
from typing import Optional

from torch import Tensor

from ..flat import FlatGroup, Slot, is_dtensor

SHARD_MODES = (None, "state", "grads")


class Local:
    """One process, no data parallelism: the window's hooks own every gradient."""

    name = "local"
    stands_aside = False  # another engine fills .grad (the hooks then do nothing)
    fast_folds = True  # nothing reads a fold's result before the step: the hooks may fold alone
    sharding = None  # the flat buffers' layout across ranks (flat.Sharding), if sharded
    sharded = False  # no full gradient survives the window's reduction (zero)
    picklable = True  # (a process group cannot be pickled)
    decided = False  # Local only: resolve() has looked for a DDP wrapper

    def join(self, window, flat: FlatGroup) -> "Local":
        """A flat group joins the window: the topology from now on. DTensor parameters (FSDP2's
        ``fully_shard``, tensor parallelism) are FSDP2's, decided now rather than at the first
        backward: a step may come first (torch.distributed.checkpoint's
        ``set_optimizer_state_dict`` steps with zero gradients to make state)."""
        if not any(is_dtensor(s.param) for s in flat.slots):
            return self
        if window.took_gradients():
            raise ValueError(
                "DTensor parameters cannot join an optimizer whose plain parameters "
                "already took gradients through its hooks"
            )
        from .fsdp import FSDP2

        return FSDP2()

    def resolve(self, params) -> "Local":
        """At the first backward: the topology for good. A DDP wrapper may have been built
        after the optimizer; it then owns ``.grad``."""
        from ..distributed import ddp_wrapping
        from .native import Native

        self.decided = True
        return Native() if ddp_wrapping(params) else self

    # --- the window's fixed points (no-ops here) ---

    def attach(self, window, slot: Slot) -> None:
        pass

    def add(self, flat: FlatGroup) -> None:
        pass

    def before_backward(self, window) -> None:
        pass

    def staging_for(self, flat: FlatGroup, bucket) -> Optional[Tensor]:
        return None

    def in_place_ok(self, window, flat: FlatGroup) -> bool:
        return True

    def added(self) -> None:
        pass

    def bucket_complete(self, flat_groups, count, flat: FlatGroup, bucket) -> None:
        pass

    def syncs(self, count) -> bool:
        return False

    def backward_ended(self, window) -> None:
        pass

    def finish(self, window) -> None:
        pass

    def take_user_grad(self, flat_groups, slot: Slot, grad: Tensor) -> bool:
        return False  # (not taken here: the window copies it into the slot's slice)

    def stats(self, flat_groups, stats) -> Optional[dict]:
        return None  # (the window's own, from the buffers)

    def after_step(self, window) -> None:
        pass

    def reset(self) -> None:
        pass

    @contextlib.contextmanager
    def no_sync(self):
        yield

    # --- the optimizer's ---

    def average_(self, value: Tensor) -> Tensor:
        return value

    def sum_stats(self, window, sumsq: Tensor, nonfinite: Tensor) -> tuple:
        return sumsq, nonfinite

    def after_step_params(self, flat_groups) -> None:
        pass

    def check_optimizer(self, window, generic: Optional[str]) -> None:
        """Raise if the optimizer cannot step these parameters (``generic``: the name of the
        torch.optim class that steps them whole, or None for a fused algorithm)."""

    def default_bucket_mb(self, device) -> float:
        # On a CPU the fold reads the bucket's gradients back: at 0.5 MB they are still in the
        # core's L2 cache (GPT-2 layout, d = 64, window_phases: a window's backwards 1-2 ms
        # faster than with 25 MB). Elsewhere DDP's 25 MB.
        return 0.5 if device.type == "cpu" else 25.0

    def before_flat_step(self, flat: FlatGroup, active: list) -> None:
        pass


def check_arguments(process_group, shard, reduce_dtype, *, fused: bool, step_in_backward: bool) -> None:
    """The constructor's data-parallel keywords, checked before anything is built (``fused``:
    the algorithm is one of ours, not a torch.optim class)."""
    if step_in_backward and process_group is not None:
        raise ValueError(
            "step_in_backward=True steps before the window is reduced across process_group: they cannot be combined"
        )
    if shard not in SHARD_MODES:
        raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
    if shard is not None and process_group is None:
        raise ValueError(f"shard={shard!r} needs a process_group to shard across")
    if shard is not None and not fused:
        raise ValueError(
            "shard= needs a fused algorithm (sgd, adam, adamw, lion): a torch.optim class steps whole parameters"
        )
    if reduce_dtype is not None and shard != "grads":
        raise ValueError("reduce_dtype= applies to shard='grads' only (the window-level reductions are fp32)")


def choose(process_group=None, shard: Optional[str] = None, reduce_dtype=None) -> Local:
    """The topology an optimizer's constructor arguments ask for (checked there). FSDP2 is
    chosen when DTensor parameters join (:meth:`Local.join`)."""
    if process_group is None:
        return Local()
    if shard is None:
        from .replicated import Replicated

        return Replicated(process_group)
    from .zero import Zero

    return Zero(process_group, shard, reduce_dtype)

"""Who owns a gradient between backward and the step: one object per data-parallel topology.

:class:`~.base.Topology` declares the fixed points the window, its folds and the step ask (the
table is in :mod:`.base`); :class:`Local`, here, is one process, and chooses its successor. Each other topology lives in its
own module: :mod:`.native` (DDP owns ``.grad``), :mod:`.replicated` (``process_group=``),
:mod:`.zero` (``shard="state"``/``"grads"``, with its sharded layout), :mod:`.fsdp` (FSDP2's
DTensor parameters, with their layout). This module chooses one from the constructor's
arguments.
"""

from __future__ import annotations

from typing import Optional

from ..registry import fused_names
from .base import Topology

SHARD_MODES = (None, "state", "grads")
# reduce_dtype="exact" (shard="grads"): each micro-batch's gradients go on the wire in their own
# dtype by an all-to-all, and each rank folds the ranks' pieces of its shard in rank order
# (fused_accum.distributed.WindowReducer); without a process group, one process whose results
# every world size's exact wire equals bit for bit (its norm is computed the same way).
EXACT = "exact"
__all__ = ["EXACT", "SHARD_MODES", "Local", "Topology", "check_arguments", "choose"]


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
            f"shard= needs a fused algorithm ({fused_names()}): a torch.optim class steps whole parameters"
        )
    if isinstance(reduce_dtype, str):
        if reduce_dtype != EXACT:
            raise ValueError(f"reduce_dtype must be a torch dtype or {EXACT!r}, got {reduce_dtype!r}")
        if shard != "grads" and (shard is not None or process_group is not None):
            raise ValueError(
                "reduce_dtype='exact' applies to shard='grads' (or to one process without a "
                "process_group, as the reference every world size equals)"
            )
        return
    if reduce_dtype is not None and shard != "grads":
        raise ValueError("reduce_dtype= applies to shard='grads' only (the window-level reductions are fp32)")


def choose(process_group=None, shard: Optional[str] = None, reduce_dtype=None) -> Topology:
    """The topology an optimizer's constructor arguments ask for (checked there). FSDP2 is
    chosen when DTensor parameters join (:meth:`Local.join`)."""
    if process_group is None:
        return Local(exact_norm=reduce_dtype == EXACT)
    if shard is None:
        from .replicated import Replicated

        return Replicated(process_group)
    from .zero import Zero

    return Zero(process_group, shard, reduce_dtype)


class Local(Topology):
    """One process, no data parallelism: the window's hooks own every gradient. Undecided until
    parameters join or the first backward: then it may give way to FSDP2's or DDP's."""

    name = "local"
    decided = False
    compiled_autograd_refusal = None  # (its folds need nothing but the accumulator)

    def __init__(self, exact_norm: bool = False) -> None:
        self.exact_norm = exact_norm  # reduce_dtype="exact": the norm of every world size's exact wire

    def in_place_ok(self, ledger, flat) -> bool:
        # reduce_dtype="exact": the ranks' gradients go on the wire in the parameters' dtype, so
        # the one process whose bits every world size equals takes them so too, never
        # fused_accum.nn's fp32 weight gradient written in place (the ranks cannot: 0.02 apart
        # on a bf16 MLP). The ordinary weight gradient is then returned, as on the ranks.
        return not self.exact_norm

    def join(self, ledger, params) -> Topology:
        """DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism) are FSDP2's,
        decided as they join rather than at the first backward: a step may come first
        (torch.distributed.checkpoint's ``set_optimizer_state_dict`` steps with zero gradients
        to make state)."""
        from ..distributed import is_dtensor

        if not any(is_dtensor(p) for p in params):
            return self
        if ledger.total > 0 or ledger.pending():
            raise ValueError(
                "DTensor parameters cannot join an optimizer whose plain parameters "
                "already took gradients through its hooks"
            )
        from .fsdp import FSDP2

        return FSDP2()

    def resolve(self, params) -> Topology:
        """At the first backward: the topology for good. A DDP wrapper may have been built
        after the optimizer; it then owns ``.grad``."""
        from ..distributed import ddp_wrapping
        from .native import Native

        self.decided = True
        return Native() if ddp_wrapping(params) else self

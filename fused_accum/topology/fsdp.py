"""FSDP2 (``fully_shard``) or tensor parallelism: DTensor parameters, whose gradients FSDP2
reduce-scatters into the sharded parameter's ``.grad``.

FSDP2 runs autograd on unsharded copies, so the window's AccumulateGrad hooks never see a
gradient: they stand aside, as under DDP. FSDP2 calls the sharded parameter's
post-accumulate-grad hooks after each reduce-scatter, once ``.grad`` is set or added to; ours
(``_grad_ready``) keeps ``.grad`` an fp32 DTensor over the parameter's
accumulator slice, so FSDP2 adds the next micro-batches into it: the accumulation is fp32 whatever
the parameter's dtype. The buffers cover the local shards only, and the window's statistics are
summed over the mesh (:class:`fused_accum.distributed.ShardSums`). Chosen when the first DTensor
parameters join (a step may come before any backward: torch.distributed.checkpoint's
``set_optimizer_state_dict`` steps with zero gradients to make state).
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
from torch import Tensor

from ..distributed import ShardSums
from . import Local


def _grad_ready(window_ref, key: int, param: Tensor) -> None:
    """FSDP2 reduce-scattered a micro-batch into ``param.grad``. A fresh ``.grad`` (FSDP2 sets one
    only where ``.grad`` was None: the window's first gradient) is copied into the parameter's
    fp32 slice and replaced by the fp32 DTensor over that slice, so FSDP2 adds the next
    micro-batches into it (``.grad._local_tensor += g``). Holds the window weakly: no cycle
    through the parameter."""
    window = window_ref()
    if window is None or window.detached_because is not None or param.grad is None:
        return
    slot = window.slots[key]
    with window.lock:
        if param.grad is not slot.grad_view:
            local = window.flat_groups[slot.flat_index].local_grad(slot, param.grad)
            slot.acc.copy_(local.reshape(-1))
            param.grad = slot.grad_view
        slot.has_grad = True
        slot.in_stats = False


class FSDP2(Local):
    name = "fsdp2"
    stands_aside = True
    fast_folds = False
    decided = True

    def __init__(self) -> None:
        self._sums = None  # ShardSums over the parameters' mesh, made at the first use

    def join(self, window, flat):
        return self

    def resolve(self, params):
        return self

    def attach(self, window, slot) -> None:
        hook = functools.partial(_grad_ready, weakref.ref(window), slot.key)
        window.add_handle(slot.param.register_post_accumulate_grad_hook(hook))

    def in_place_ok(self, window, flat) -> bool:
        return False

    def check_optimizer(self, window, generic: Optional[str]) -> None:
        if generic is not None:
            raise ValueError(
                f"optimizer={generic} cannot step DTensor parameters (it would see local "
                "shards as whole parameters); use a fused algorithm (sgd, adam, adamw, lion)"
            )
        if window.wants_stats:  # (made now: it refuses parameters on more than one mesh)
            self._sums = ShardSums(s.param for s in window.slots)

    def sum_stats(self, window, sumsq: Tensor, nonfinite: Tensor) -> tuple:
        """The window's sum of squares and non-finite count are of local shards: summed over
        the mesh, in one all-reduce."""
        both = self._sums.sum_(torch.stack([sumsq, nonfinite]))
        return both[0], both[1]

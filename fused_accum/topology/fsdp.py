"""FSDP2 (``fully_shard``) or tensor parallelism: DTensor parameters, whose gradients FSDP2
reduce-scatters into the sharded parameter's ``.grad``.

FSDP2 runs autograd on unsharded copies, so the window's AccumulateGrad hooks never see a
gradient: they stand aside, as under DDP. FSDP2 calls the sharded parameter's
post-accumulate-grad hooks after each reduce-scatter, once ``.grad`` is set or added to; ours
(``_grad_ready``) keeps ``.grad`` an fp32 DTensor over the parameter's
accumulator slice, so FSDP2 adds the next micro-batches into it: the accumulation is fp32 whatever
the parameter's dtype. The buffers cover the local shards only (:class:`DTensorLayout`), and the
window's statistics are summed over the mesh (:class:`fused_accum.distributed.ShardSums`). Chosen
when the first DTensor parameters join (a step may come before any backward:
torch.distributed.checkpoint's ``set_optimizer_state_dict`` steps with zero gradients to make
state).

Under ``offload="cpu"`` the host layout (:class:`fused_accum.host.HostLayout`) wraps
:class:`DTensorLayout`: the local shards and their fp32 accumulator slices stay on the device,
their masters, state and host copies are on the host, where every window steps at ``step()``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
from torch import Tensor

from ..arrivals import _untraced
from ..distributed import ShardSums, is_dtensor, local_tensor
from ..flat import Layout
from ..registry import fused_names
from .base import Topology


def _grad_ready(window_ref, key: int, param: Tensor) -> None:
    """FSDP2 reduce-scattered a micro-batch into ``param.grad``. A fresh ``.grad`` (FSDP2 sets one
    only where ``.grad`` was None: the window's first gradient) is taken into the parameter's fp32
    slice and replaced by the fp32 DTensor over that slice, so FSDP2 adds the next micro-batches
    into it (``.grad._local_tensor += g``). Holds the window weakly: no cycle through the
    parameter."""
    window = window_ref()
    if window is not None and window.detached_because is None and param.grad is not None:
        _take_grad(window, window.slots[key], param.grad)


def _take_grad(window, slot, grad: Tensor) -> None:
    """FSDP2's micro-batch gradient, handed to the window whole: copied into the slot's slice,
    which ``.grad`` shows from then."""
    with window.lock:
        if grad is not slot.grad_view:
            local = window.flat_groups[slot.flat_index].user_grad(slot, grad)
            slot.acc.copy_(local.reshape(-1))
            slot.param.grad = slot.grad_view
        window.ledger.took_grad(slot)


def _local(t: Tensor) -> Tensor:
    """What this rank stores of ``t`` (:func:`local_tensor`) without an op: a DTensor's
    ``_local_tensor`` (the attribute DTensor keeps it in: torch's own FSDP2 reads it so)."""
    return getattr(t, "_local_tensor", t)


class DTensorLayout(Layout):
    """DTensor parameters, stored and stepped by their local shard (:func:`local_tensor`, for an
    FSDP2 parameter a view of FSDP2's sharded storage): the slices, masters and state cover what
    this rank holds, and ``.grad`` and ``opt.state`` show DTensors over them, of the parameter's
    mesh and placements, as torch.optim's are."""

    def stored(self, param: Tensor) -> Tensor:
        return local_tensor(param)

    def set_views(self, flat, slot) -> None:
        super().set_views(flat, slot)
        q = slot.param
        if is_dtensor(q):  # .grad is a DTensor over this rank's fp32 slice
            slot._grad_view = type(q).from_local(
                slot.full_view, q.device_mesh, q.placements, run_check=False, shape=q.shape, stride=q.stride()
            )

    def step_lists(self, flat, active: list) -> tuple:
        """The one-process lists, each DTensor parameter replaced by its local shard itself
        (``_local_tensor``: FSDP2's sharded storage, or a view of it, which the step updates in
        place), read as an attribute at each step: no op per parameter (``to_local()`` made a
        view of each, 2 aten ops per parameter per step), and whatever FSDP2 re-shards or
        replaces is read as it is now."""
        return (
            active,
            [s.acc for s in active],
            flat.masters.step_tensors(active, list(map(_local, (s.param for s in active)))),
        )

    def user_grad(self, flat, slot, grad: Tensor) -> Tensor:
        """The local shard of a DTensor gradient in the parameter's placements (FSDP2's is
        already; a Partial one from tensor parallelism is reduced first, as torch.optim's
        DTensor arithmetic would)."""
        p = slot.param
        if not is_dtensor(grad):
            return grad
        if grad.placements != p.placements or grad.device_mesh != p.device_mesh:
            grad = grad.redistribute(p.device_mesh, p.placements)
        return local_tensor(grad)

    def loaded(self, flat, slot, value: Tensor) -> Tensor:
        """A DTensor value: its local shard, placed as the parameter is; a plain tensor of the
        whole parameter's shape (torch's full state dict, an unsharded optimizer's): cut to this
        rank's shard without communication."""
        p = slot.param
        if is_dtensor(value):
            value = self.user_grad(flat, slot, value)
        elif is_dtensor(p) and value.shape == p.shape and value.shape != local_tensor(p).shape:
            from torch.distributed.tensor import distribute_tensor

            # src_data_rank=None: every rank cuts its own shard of the value it holds
            value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
        return super().loaded(flat, slot, value)

    def state_view(self, flat, slot, buf: Tensor) -> Tensor:
        """A DTensor over ``buf`` (no copy: in-place edits go through) with the parameter's mesh,
        placements and global shape, as torch.optim keeps its state."""
        p = slot.param
        if not is_dtensor(p):
            return super().state_view(flat, slot, buf)
        return type(p).from_local(
            buf.view(local_tensor(p).shape),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )

    def saves_accum(self, slot) -> bool:
        return False  # the window's gradient is the .grad FSDP2 adds into, which torch.optim saves not either


class FSDP2(Topology):
    name = "fsdp2"
    stands_aside = True
    fast_folds = False

    def __init__(self) -> None:
        self._sums = None  # ShardSums over the parameters' mesh, made at the first use

    def layout(self) -> DTensorLayout:
        return DTensorLayout()

    def attach(self, window, slot) -> None:
        hook = _untraced(functools.partial(_grad_ready, weakref.ref(window), slot.key))  # (see arrivals)
        window.add_handle(slot.param.register_post_accumulate_grad_hook(hook))

    def in_place_ok(self, ledger, flat) -> bool:
        return False

    def final_at_bucket(self, ledger) -> bool:
        return False  # FSDP2 adds into .grad until the window's last backward ends (offload steps at step())

    def check_optimizer(self, ledger, generic: Optional[str]) -> None:
        if generic is not None:
            raise ValueError(
                f"optimizer={generic} cannot step DTensor parameters (it would see local "
                f"shards as whole parameters); use a fused algorithm ({fused_names()})"
            )
        if ledger.wants_stats:  # (made now: it refuses parameters on more than one mesh)
            self._sums = ShardSums(s.param for s in ledger.slots)

    def norm_terms(self, ledger, flat_groups, home) -> tuple:
        """The window's sum of squares and non-finite count are of local shards: summed over
        the mesh, in one all-reduce."""
        sumsq, nonfinite = super().norm_terms(ledger, flat_groups, home)
        both = self._sums.sum_(torch.stack([sumsq, nonfinite]))
        return both[0], both[1]

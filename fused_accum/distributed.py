"""Data parallelism for FusedAccumOptimizer: average the window's fp32 accumulators across a
process group once per optimizer step, not once per micro-batch.

DistributedDataParallel all-reduces every backward unless each micro-batch but the last runs
under ``no_sync()``; here the reduction belongs to the window by construction. Buckets are the
optimizer's own (each a contiguous range of a flat buffer): those completed during the window's
last backward are reduced asynchronously while the rest of that backward runs, the others when
it ends. The reduction is a sum divided by the world size (DDP's average), done on the fp32
accumulators, so no precision is lost in the collective either.
"""
from __future__ import annotations

import gc

import torch.distributed as dist
from torch import Tensor


def ddp_wrapping(params) -> bool:
    """Whether a live DistributedDataParallel module manages any of ``params``.

    DDP reads each gradient in a hook that runs after ours (on the AccumulateGrad node, while
    ours is the parameter's post-accumulate-grad hook), so it must see autograd's ``.grad``.
    Asked once per optimizer, at its first backward, and only in a multi-process run: it walks
    the objects the garbage collector tracks (tens of ms for a large program).
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p) for p in params}
    return any(
        isinstance(obj, DistributedDataParallel) and any(id(p) in wanted for p in obj._module_parameters)
        for obj in gc.get_objects()
    )


class WindowReducer:
    """All-reduces the accumulator buckets at a window's end; the window calls it.

    Collectives pair up by the order in which ranks issue them, so buckets are always launched
    in one fixed order (flat groups, then buckets: the order backward usually completes them).
    A bucket completed early waits for those before it; if a rank lacks a gradient that another
    has, the orders still agree.
    """

    def __init__(self, group) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("process_group was given but torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")  # fmt: skip
        self.group = group
        self.world = dist.get_world_size(group)
        # NCCL averages in the collective; gloo has no AVG, so its sum is divided after (one
        # more pass over the buffer, 8 B per param per window).
        self._avg_op = getattr(dist.ReduceOp, "AVG", None) if dist.get_backend(group) == "nccl" else None
        self._works, self._ready, self._launched = [], set(), set()

    def bucket_ready(self, flat_groups, bucket) -> None:
        """``bucket`` holds its final local values: launch it and any ready ones after it."""
        self._ready.add(id(bucket))
        self._launch(flat_groups, only_ready=True)

    def finish(self, flat_groups) -> None:
        """Reduce what is left, wait for everything, and average. Afterwards every slot holds
        the group's gradient (zero where no rank had one)."""
        self._launch(flat_groups, only_ready=False)
        works, self._works = self._works, []
        for work in works:
            work.wait()
        for flat in flat_groups:
            if self._avg_op is None:
                flat.acc.div_(self.world)  # padding is zero: dividing the whole buffer is one pass
            for slot in flat.slots:
                slot.has_grad = True
        self._ready, self._launched = set(), set()

    def average_(self, value: Tensor) -> Tensor:
        """``value`` (a 0-d device tensor) replaced by its mean over the group, in place."""
        dist.all_reduce(value, group=self.group)
        return value.div_(self.world)

    def reset(self) -> None:
        """Forget a window discarded mid-reduction (its collectives still complete first)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self._ready, self._launched = set(), set()

    def _launch(self, flat_groups, only_ready: bool) -> None:
        for flat in flat_groups:
            for bucket in flat.buckets:
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
                self._works.append(dist.all_reduce(segment, op=op, group=self.group, async_op=True))
                self._launched.add(id(bucket))

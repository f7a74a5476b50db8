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

import torch.distributed as dist
from torch import Tensor


class WindowReducer:
    """All-reduces the accumulator buckets of one window; the optimizer calls it.

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
        self.reset()

    def bucket_ready(self, flat_groups, bucket) -> None:
        """``bucket`` holds its final local values: launch it and any ready ones after it."""
        self._ready.add(id(bucket))
        self._launch(flat_groups, only_ready=True)

    def launched(self, bucket) -> bool:
        return id(bucket) in self._launched

    def finish(self, flat_groups) -> None:
        """Reduce what is left, wait for everything, and average. Afterwards every slot holds
        the group's gradient (zero where no rank had one)."""
        self._launch(flat_groups, only_ready=False)
        for work in self._works:
            work.wait()
        for flat in flat_groups:
            flat.acc.div_(self.world)  # padding is zero: dividing the whole buffer is one pass
            for slot in flat.slots:
                slot.has_grad = True
        self._works, self.done = [], True

    def average_(self, value: Tensor) -> Tensor:
        """``value`` (a 0-d device tensor) replaced by its mean over the group, in place."""
        dist.all_reduce(value, group=self.group)
        return value.div_(self.world)

    def reset(self) -> None:
        for work in getattr(self, "_works", []):  # a window discarded mid-reduction
            work.wait()
        self._works, self._ready, self._launched, self.done = [], set(), set(), False

    def _launch(self, flat_groups, only_ready: bool) -> None:
        for flat in flat_groups:
            for bucket in flat.buckets:
                if id(bucket) in self._launched:
                    continue
                if only_ready and id(bucket) not in self._ready:
                    return  # keep the fixed order: later buckets wait for this one
                # A slice this rank has no gradient for holds last window's values: zero it.
                for slot in bucket.slots:
                    if not slot.has_grad:
                        slot.acc.zero_()
                segment = flat.acc[bucket.start : bucket.end]
                self._works.append(dist.all_reduce(segment, group=self.group, async_op=True))
                self._launched.add(id(bucket))

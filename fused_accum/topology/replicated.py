"""``process_group=`` without sharding: every rank keeps the whole fp32 window and the window is
all-reduced (averaged) once, bucket by bucket, overlapping its last backward.

Which backward reduces: the last one of the window when ``accum_steps`` says which it is; every
backward without ``accum_steps`` (each may be the last) and after ``no_sync()`` was used, the
first one outside it (DDP's rule). Buckets are launched in one fixed order on every rank
(:class:`fused_accum.distributed.WindowReducer`).
"""

from __future__ import annotations

import contextlib

from ..distributed import WindowReducer
from ..flat import is_dtensor
from . import Local


class Replicated(Local):
    name = "replicated"
    fast_folds = False  # a fold's result is reduced: Python sees every bucket
    decided = True

    def __init__(self, process_group, shard=None, reduce_dtype=None) -> None:
        self.reducer = WindowReducer(process_group, shard, reduce_dtype)
        self.sharding = self.reducer.sharding
        self._no_sync = False
        self._no_sync_used = False
        self._unreduced = False  # gradients were added since the last reduction

    def join(self, window, flat):
        if any(is_dtensor(s.param) for s in flat.slots):
            raise ValueError(
                "the parameters are DTensors (FSDP2's fully_shard or tensor parallelism), "
                "whose gradients FSDP2 reduces: process_group= and shard= cannot be added"
            )
        return self

    def resolve(self, params):
        return self  # (a process group of our own: the hooks reduce, no DDP wrapper may)

    picklable = False

    def default_bucket_mb(self, device) -> float:
        return 25.0  # each bucket is a collective, and sharded checkpoints are laid out by them

    def added(self) -> None:
        self._unreduced = True

    def syncs(self, count) -> bool:
        if self._no_sync:
            return False
        steps = count.accum_steps
        return steps is None or self._no_sync_used or count.microbatches >= steps - 1

    def bucket_complete(self, flat_groups, count, flat, bucket) -> None:
        if self.syncs(count):
            self.reducer.bucket_ready(flat_groups, bucket)  # overlaps the rest of the backward

    def finish(self, window) -> None:
        if self._unreduced:
            self.reducer.finish(window.flat_groups)
            self._unreduced = False
            window.invalidate_stats()  # any local norm described local values

    def reset(self) -> None:
        self._unreduced = False
        self.reducer.reset()

    @contextlib.contextmanager
    def no_sync(self):
        self._no_sync_used = True
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def average_(self, value):
        return self.reducer.average_(value)  # gradients are the group's mean: so the counts

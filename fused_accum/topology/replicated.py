"""``process_group=`` without sharding: every rank keeps the whole fp32 window and the window is
all-reduced (averaged) once, bucket by bucket, overlapping its last backward.

Which backward reduces: the last one of the window when ``accum_steps`` says which it is; every
backward without ``accum_steps`` (each may be the last) and after ``no_sync()`` was used, the
first one outside it (DDP's rule). Buckets are launched in one fixed order on every rank
(:class:`fused_accum.distributed.WindowReducer`).
"""

from __future__ import annotations

import contextlib

from ..distributed import WindowReducer, is_dtensor
from .base import Topology


class Replicated(Topology):
    name = "replicated"
    fast_folds = False  # a fold's result is reduced: Python sees every bucket
    picklable = False

    def __init__(self, process_group, shard=None, reduce_dtype=None) -> None:
        self.reducer = WindowReducer(process_group, shard, reduce_dtype)
        self._no_sync = False
        self._no_sync_used = False
        self._unreduced = False  # gradients were added since the last reduction

    def join(self, ledger, params):
        if any(is_dtensor(p) for p in params):
            raise ValueError(
                "the parameters are DTensors (FSDP2's fully_shard or tensor parallelism), "
                "whose gradients FSDP2 reduces: process_group= and shard= cannot be added"
            )
        return self

    def default_bucket_mb(self, device) -> float:
        return 25.0  # each bucket is a collective, and sharded checkpoints are laid out by them

    def added(self) -> None:
        self._unreduced = True

    def syncs(self, ledger) -> bool:
        if self._no_sync:
            return False
        steps = ledger.accum_steps
        return steps is None or self._no_sync_used or ledger.microbatches >= steps - 1

    def final_at_bucket(self, ledger) -> bool:
        return not self.syncs(ledger)  # (a reduced bucket is final only once its collective is)

    def bucket_complete(self, flat_groups, ledger, flat, bucket) -> None:
        if self.syncs(ledger):
            self.reducer.bucket_ready(flat_groups, bucket)  # overlaps the rest of the backward

    def finish(self, ledger, flat_groups) -> None:
        if self._unreduced:
            others = self.reducer.finish(flat_groups)
            self._unreduced = False
            ledger.reduced(others)  # the group's gradient, and which slots have one

    def backward_raised(self, ledger, flat_groups) -> None:
        """A backward that had begun the window's reduction (buckets launched as they completed)
        raised: the reduction is completed now, in the fixed bucket order, so every rank issues
        the same collectives whichever bucket it raised at (left half done, the ranks' next
        collectives would pair with the wrong ones, and a retried backward would never reduce
        the buckets already launched: the ranks drifted apart, 2e-2 in 4 windows). The window
        then holds the group's gradient of what arrived (the partial gradients stay, as torch
        keeps them in ``.grad``); a retried backward reduces again (the group's mean plus each
        rank's new gradient reduces to the mean plus the group's)."""
        if self.reducer.reducing:
            self.finish(ledger, flat_groups)

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

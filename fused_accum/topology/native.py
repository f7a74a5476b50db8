"""DistributedDataParallel owns ``.grad``: the window's hooks stand aside.

DDP reads each gradient in a hook on the AccumulateGrad node that runs after ours and reduces
autograd's ``.grad`` in its own buckets, so it must see autograd's ``.grad``: our hooks do
nothing and the step takes ``.grad`` as a user-assigned gradient (optimizer's
``_take_user_grads``). Chosen at the first backward, by :meth:`Local.resolve`, since the DDP
wrapper may be built after the optimizer.
"""

from __future__ import annotations

from .base import Topology


class Native(Topology):
    name = "native"
    stands_aside = True
    fast_folds = False

    def in_place_ok(self, ledger, flat) -> bool:
        return False  # DDP must see the weight's gradient to reduce it
